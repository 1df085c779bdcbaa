"""One adapter per engine + connector (base.py: the interface; registry.py: the list)."""
