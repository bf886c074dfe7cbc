"""Admission control: the router-side queue in front of dispatch (docs/admission.md).

``config`` (the ``admission:`` section), ``queue`` (classes, ageing, bounds), ``fairness``
(weighted fair sharing between tenants), ``full`` (when a backend is full; late-bound placement),
``gate`` (the gateway's asyncio adapter) and ``metrics`` (``hetroute_queue_*``). The simulator
runs the same queue through ``hetroute.simulation.admission_run``.
"""
