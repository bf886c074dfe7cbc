"""hetroute.backends."""
