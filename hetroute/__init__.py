"""hetroute: a workload-aware request router for LLM serving on heterogeneous GPU clusters."""

__version__ = "0.1.0"
__all__ = ["__version__"]
