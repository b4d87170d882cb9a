"""Draft proposers behind one interface (base.py) and a registry (registry.py)."""
