"""MegaTrain: train LLMs larger than GPU memory on one GPU by keeping all state in host memory.

The Python API (megatrain.api): Trainer (the train command as an object), TrainResult, Engine (one system driven
step by step); imported when first used, so that `python -m megatrain --help` needs no torch."""

__version__ = "0.1.0"
API = ("Trainer", "TrainResult", "Engine")


def __getattr__(name: str):
    if name in API:
        from megatrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
