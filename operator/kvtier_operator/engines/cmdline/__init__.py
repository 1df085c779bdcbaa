"""Engine-neutral command-line handling: argv words, `sh -c` scripts, the kubelet's $(VAR)
expansion. Each engine names its entry point (engines/<engine>/entry.py)."""
