"""The dtypes dflash-mlx computes in, by the names its options, configs and results use."""

import mlx.core as mx

# float32 first: on MLX's CPU backend it runs several times faster than the other two.
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def dtype_name(dtype: mx.Dtype) -> str | None:
    """The name of ``dtype`` in :data:`DTYPES`, or None for any other dtype."""
    return next((name for name, d in DTYPES.items() if d == dtype), None)
