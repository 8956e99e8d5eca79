"""dflash-convert: Hugging Face checkpoints to MLX, targets and DFlash drafters."""
