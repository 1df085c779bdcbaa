"""Pure renderers: a validated TieredPrefixCache in, Kubernetes objects out.

No API calls, no clock, no randomness: the same input always renders the same output.
"""
