"""Offline profiling: measure a live engine and fit its latency curves (method.md §3)."""
