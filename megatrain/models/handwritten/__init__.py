"""The hand-written models: our own modules for the families we wrote (megatrain.models.handwritten.families lists
them), their shape (ModelConfig) and their Hugging Face checkpoints."""
