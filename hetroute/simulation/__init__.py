"""The gateway's own routing code driven over simulated engines (``hetroute simulate``).

Modules: ``simulator`` builds the real router, policy, ledger, learner and predictor over a fleet of
engine models and runs them (:func:`~hetroute.simulation.simulator.run_simulation`); ``run`` the event
loop of one run; ``admission_run`` the run with the admission queue in front; ``report`` the table,
JSON and plot of a run matrix. This package stands above both ``hetroute.sim`` (engines, workloads)
and the router (``hetroute.policies``, ``hetroute.routing``, ``hetroute.admission``); neither imports it.
"""
