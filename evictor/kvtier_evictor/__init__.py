"""kvtier evictor: keeps the shared KV volume under its watermarks with true LRU.

Stdlib only, and no Kubernetes API access: it reports through its termination message.
"""

__version__ = "0.1.0"
