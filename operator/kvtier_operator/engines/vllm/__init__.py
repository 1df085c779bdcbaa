"""vLLM on NVIDIA GPUs: its command line (entry, launch), sizing, and the adapters of its
connectors (gpu: native and LMCache; kvbm; mooncake)."""
