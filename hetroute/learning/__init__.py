"""Live latency learning: each backend's p1..p8 fitted from the traffic the router serves."""
