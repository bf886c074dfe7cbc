"""Routing: the ledger (per-request accounting) and the router (per-request orchestration)."""
