"""dflash-train: the drafter's training recipe, its data step, tap cache and checkpoints."""
