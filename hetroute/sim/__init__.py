"""hetroute.sim."""
