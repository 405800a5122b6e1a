"""The performance model: a step's time replayed from measured ingredients (model), their measurement (ingredients,
layer_profile), and its check against every engine record and projection onto machines we cannot rent (model_check).
Its outputs are in results/perf_model/, its inputs in results/ingredients/."""
