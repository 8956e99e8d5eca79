"""PyTorch reference implementation of DFlash (optional extra: mlx-dflash[reference])."""
