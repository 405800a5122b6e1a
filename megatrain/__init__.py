"""MegaTrain: train LLMs larger than GPU memory on one GPU by keeping all state in host memory."""

__version__ = "0.1.0"
