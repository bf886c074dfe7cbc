"""The simulated world: the engine model (its vLLM and TGI schedulers, its step timers), the HTTP emulator,
workloads and cluster files.

Nothing here imports the router (``hetroute.policies``, ``hetroute.routing``, ``hetroute.proxy``):
``hetroute.simulation`` runs the real router in this world (``tests/unit/test_import_layers.py``).
"""
