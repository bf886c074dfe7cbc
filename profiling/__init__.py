"""Offline profiling: measure a live engine and fit its latency curves (method.md §2–3).

``discover`` (model, limits, KV capacity) → ``calibrate`` (probe requests) → ``collect`` (the sweep,
over ``client``) → ``fit`` (p1..p8, held-out quality) → ``artifact`` (the ``hetroute.latency`` schema);
``runner`` runs them in order for ``hetroute profile``; ``plot`` draws measured versus fitted;
``emulated`` profiles the emulator to make ``config/profiles/``. The router never imports this package.
"""
