"""The admission queue alone: priorities, ageing, weighted fairness, bounds, config errors."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from hetroute.admission.config import AdmissionConfig, ClassConfig, parse_admission
from hetroute.admission.queue import AdmissionQueue, Shed
from hetroute.errors import ConfigError, NoBackendAvailable
from hetroute.routing.ledger import Ledger, Ticket
from hetroute.types import RequestFeatures

_ids = itertools.count()


def feat(tokens: int = 100) -> RequestFeatures:
    return RequestFeatures(f"r{next(_ids)}", "m", "openai", tokens // 2, None, tokens - tokens // 2)


class Slots:
    """A fake ``place``: ``free`` tickets, then None (every backend full)."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.ledger = Ledger(["b"])
        self.placed: list[str] = []

    def __call__(
        self, f: RequestFeatures, waiting: int = 1, klass: ClassConfig | None = None
    ) -> Ticket | None:
        if self.free <= 0:
            return None
        self.free -= 1
        self.placed.append(f.request_id)
        return self.ledger.dispatch(
            request_id=f.request_id, backend_index=0, input_tokens=1, predicted_output_tokens=1,
            workload_cost=0.0, now_s=0.0,
        )  # fmt: skip


def two_classes(**batch: Any) -> AdmissionConfig:
    return AdmissionConfig(
        classes=(ClassConfig("interactive"), ClassConfig("batch", **batch)), default_class="batch"
    )


def test_strict_priority_then_fifo() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(two_classes())
    for tag, cls in [("b1", 1), ("i1", 0), ("b2", 1), ("i2", 0)]:
        q.offer(feat(), cls, "t", tag, now_s=0.0)
    out = q.pump(0.0, Slots(4))
    assert [e.payload for e, _ in out.dispatched] == ["i1", "i2", "b1", "b2"]
    assert len(q) == 0


def test_pump_stops_at_a_head_that_does_not_fit() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(two_classes())
    q.offer(feat(), 1, "t", "b", 0.0)
    q.offer(feat(), 0, "t", "i", 0.0)
    out = q.pump(0.0, Slots(1))
    assert [e.payload for e, _ in out.dispatched] == ["i"] and len(q) == 1


def test_ageing_serves_a_starved_class_once_per_bound() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(two_classes(ageing_s=5.0))
    q.offer(feat(), 1, "t", "b1", 0.0)
    q.offer(feat(), 1, "t", "b2", 0.0)
    for k in range(4):
        q.offer(feat(), 0, "t", f"i{k}", 0.0)
    assert q.pump(1.0, Slots(1)).dispatched[0][0].payload == "i0"  # not yet starved
    assert q.pump(6.0, Slots(1)).dispatched[0][0].payload == "b1"  # waited 6 s > 5 s: goes first
    assert q.pump(7.0, Slots(1)).dispatched[0][0].payload == "i1"  # batch was served 1 s ago
    assert q.pump(11.5, Slots(1)).dispatched[0][0].payload == "b2"


def test_weighted_fair_share_between_backlogged_tenants() -> None:
    cfg = AdmissionConfig(tenant_weights={"a": 3.0, "b": 1.0})
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    for _ in range(400):
        q.offer(feat(), 0, "a", "a", 0.0)
        q.offer(feat(), 0, "b", "b", 0.0)
    out = q.pump(0.0, Slots(400))
    served = [e.payload for e, _ in out.dispatched]
    assert served.count("a") == 300 and served.count("b") == 100
    # and at every prefix, within one request of the 3:1 split
    for n in range(4, 400, 4):
        assert abs(served[:n].count("a") - 3 * n / 4) <= 1.0


def test_an_idle_tenant_banks_no_credit() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(AdmissionConfig())
    for _ in range(10):
        q.offer(feat(), 0, "a", "a", 0.0)
    q.pump(0.0, Slots(10))
    for _ in range(10):
        q.offer(feat(), 0, "a", "a", 1.0)
        q.offer(feat(), 0, "b", "b", 1.0)
    served = [e.payload for e, _ in q.pump(1.0, Slots(10)).dispatched]
    assert served.count("a") == 5 and served.count("b") == 5


def test_bounds_queue_full_expiry_and_removal() -> None:
    cfg = AdmissionConfig(classes=(ClassConfig(max_queue_len=2, max_queue_wait_s=3.0, retry_after_s=4),))
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    e1 = q.offer(feat(), 0, "t", "1", 0.0)
    q.offer(feat(), 0, "t", "2", 1.0)
    with pytest.raises(Shed) as shed:
        q.offer(feat(), 0, "t", "3", 1.0)
    assert shed.value.reason == "queue_full" and shed.value.retry_after_s == 4
    assert q.next_deadline_s() == 3.0
    assert q.remove(e1) and not q.remove(e1)
    assert q.next_deadline_s() == 4.0
    assert [e.payload for e in q.expire(3.9)] == []
    assert [e.payload for e in q.expire(4.0)] == ["2"]
    assert len(q) == 0 and q.next_deadline_s() is None


def test_a_placement_error_goes_to_its_waiter_and_the_pump_goes_on() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(AdmissionConfig())
    bad = feat()
    q.offer(bad, 0, "t", "bad", 0.0)
    q.offer(feat(), 0, "t", "good", 0.0)
    slots = Slots(1)

    def place(f: RequestFeatures, waiting: int, klass: ClassConfig) -> Ticket | None:
        if f is bad:
            raise NoBackendAvailable("m")
        return slots(f)

    out = q.pump(0.0, place)
    assert [e.payload for e, _ in out.failed] == ["bad"]
    assert [e.payload for e, _ in out.dispatched] == ["good"] and len(q) == 0


def test_config_parses_and_errors_name_the_field() -> None:
    cfg = parse_admission(
        {
            "classes": [{"name": "interactive", "max_queue_wait_s": 5}, {"name": "batch", "ageing_s": 10}],
            "tenants": {"a": 3, "b": 1},
            "api_keys": {"sk-1": {"class": "interactive", "tenant": "a"}},
            "full": {"kv_high_water_frac": 1.2},
        }
    )
    assert cfg.default_class == "batch" and cfg.weight_of("a") == 3.0 and cfg.weight_of("zz") == 1.0
    assert cfg.classes[0].retry_after == 5 and cfg.full.kv_high_water_frac == 1.2
    assert parse_admission(None) == AdmissionConfig()
    bad: list[tuple[Any, str]] = [
        ({"classes": [{"name": "a"}, {"name": "a"}]}, "admission.classes[1].name"),
        ({"classes": [{"name": "a", "max_queue_wait_s": 0}]}, "admission.classes[0].max_queue_wait_s"),
        ({"default_class": "nope"}, "admission.default_class"),
        ({"tenants": {"a": -1}}, "admission.tenants.a"),
        ({"full": {"kv_high": 1}}, "admission.full.kv_high"),
        ({"api_keys": {"sk-1234": {"class": "x"}}}, "admission.api_keys.sk-1….class"),
        ({"enabled": "yes"}, "admission.enabled"),
        ({"bogus": 1}, "admission.bogus"),
    ]
    for raw, path in bad:
        with pytest.raises(ConfigError) as err:
            parse_admission(raw)
        assert err.value.path == path
