"""`make bench`: speed and scale, each as a ratio against an anchor measured in the same run.

Benchmarks are not tests: they print numbers for docs/benchmarks.md and assert nothing.
"""
