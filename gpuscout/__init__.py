"""gpuscout: which GPU instance (and which settings on it) fine-tunes my model fastest per dollar."""

__version__ = "0.1.0"
