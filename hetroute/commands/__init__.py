"""hetroute.commands."""
