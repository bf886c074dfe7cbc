"""Shared knowledge about hardware and models: the GPU and model catalogs and the roofline step time.

``specs`` owns the catalogs (``GpuSpec``, ``ModelSpec``, their loaders) and the KV-capacity arithmetic;
``roofline`` turns one engine step into seconds. The simulated engines (``hetroute.sim``), the
deployment tuner (``hetroute.tuner``) and the routing policies (``hetroute.policies``, through the
roofline prior) all read this package; it imports none of them, only ``hetroute.errors``
(``tests/unit/test_import_layers.py`` holds it to that).
"""
