"""``hetroute tune-deploy``: choosing tensor-parallel degrees per machine (method.md §4).

Modules: ``cluster`` (+ ``fields``) the validated cluster file; ``feasibility`` memory feasibility (§2);
``algorithm1`` the paper's estimate, fixed; ``iteration`` the iteration-level continuous-batching estimate
(the engine model's vLLM scheduler, ``hetroute.sim.vllm_scheduler``, timed by fitted p1..p8);
``estimate`` one configuration end to end; ``search`` the per-machine and exact joint choice; ``tune`` the
pipeline; ``report`` table/JSON/PNG; ``emit`` router config and docker-compose; ``groundtruth`` the
engine-model measurement the estimates are validated against. The tuner imports nothing of the router.
"""
