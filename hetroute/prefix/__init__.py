"""Prefix-cache locality: chained block hashes, the router's per-backend prefix index, session affinity.

Dependency rule: this package imports only numpy and :mod:`hetroute.types`, so the engine model
(``sim/``), the router (``routing/``), the policies and the proxy may all import it.
"""
