"""Checks of the models against their reference that are not benchmarks: which of transformers' causal LMs the
generic path trains equal to transformers (walk.py; scripts/walk_transformers.py writes results/generic/)."""
