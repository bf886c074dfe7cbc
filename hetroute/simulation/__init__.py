"""hetroute.simulation."""
