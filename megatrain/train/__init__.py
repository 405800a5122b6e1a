"""`python -m megatrain train`: from a Hugging Face checkpoint (or a registry shape) and your data to a trained
Hugging Face checkpoint, with a learning-rate schedule, checkpoints and resume, on any system."""
