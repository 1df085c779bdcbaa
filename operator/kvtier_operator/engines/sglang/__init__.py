"""SGLang with HiCache: its command line (entry, flags), the HiCache flags and env, and
the adapter."""
