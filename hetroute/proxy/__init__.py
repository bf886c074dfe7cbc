"""hetroute.proxy."""
