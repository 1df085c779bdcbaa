"""kvtier FS offload backend, loaded inside vLLM's Python.

Stdlib and numpy only (torch for the GPU path, prometheus-client optional): never
kopf, kubernetes or pydantic, and nothing that changes vLLM's dependency set.
"""

__version__ = "0.1.0"
