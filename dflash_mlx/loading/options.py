"""The options of a load checked before any file is touched."""

import mlx.core as mx

from ..base.dtypes import DTYPES
from ..base.errors import DFlashError
from ..cpu.openblas import note_reference_blas
from ..kernels import check_kernels


def check_load_options(*, dtype: str | None, kernels: str) -> None:
    """Refuse a bad ``dtype`` or ``kernels`` in one line; on the CPU, say once when MLX runs on
    its slow reference BLAS.

    Raises:
        DFlashError: For a dtype not in ``DTYPES``, or a bad ``kernels`` (see ``check_kernels``).
    """
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"Unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    check_kernels(kernels)
    if mx.default_device() == mx.cpu:
        note_reference_blas()
