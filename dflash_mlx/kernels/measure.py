"""Check and time every kernel against its twin at a verify pass's shapes, on this Mac.

``python -m dflash_mlx.kernels.measure`` runs each dispatcher's own check (compare on random
inputs, then time both) at the shapes below, without reading or writing the verdicts kept in
dflash-mlx's cache folder unless ``--save``, and prints one line per shape class (``--json``: a
JSON list). Off Metal it says so and exits: the twins are what runs there.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from ..base.dtypes import DTYPES
from .accept import greedy_accept
from .dispatch import KernelStore, on_metal
from .gdn import gated_delta_states
from .gdn_tree import gated_delta_tree, random_parents
from .qmm import verify_qmm

# (rows of a block, vocabulary): Qwen3's and Llama 3's vocabularies at blocks 16 and 8.
ACCEPT_SHAPES = [(16, 151936), (8, 151936), (16, 128256)]
# (M, N, K, bits, group_size): Qwen3-8B-like projections at a block of 16, and smaller M.
QMM_SHAPES = [
    (16, 4096, 4096, 4, 64),
    (16, 12288, 4096, 4, 64),
    (16, 4096, 12288, 4, 64),
    (8, 4096, 4096, 4, 64),
    (16, 4096, 4096, 8, 64),
    (16, 2048, 2048, 4, 32),
]
# (positions, Hk, Hv, Dk = Dv): Qwen3.5-4B's and -0.8B's Gated DeltaNet heads at blocks 16 and 8.
GDN_SHAPES = [(16, 16, 32, 128), (8, 16, 32, 128), (16, 16, 16, 128)]
# (nodes, Hk, Hv, Dk = Dv): draft trees of budgets 16 and 64 (the root and the drafts) on the same heads.
GDN_TREE_SHAPES = [(17, 16, 32, 128), (65, 16, 32, 128), (17, 16, 16, 128)]


def _cases(dtype: mx.Dtype):
    for rows, vocab in ACCEPT_SHAPES:
        yield greedy_accept, (mx.zeros((rows, vocab), dtype=dtype), mx.zeros((rows - 1,), dtype=mx.int32))
    for M, N, K, bits, group_size in QMM_SHAPES:
        w = mx.zeros((N, K * bits // 32), dtype=mx.uint32)
        groups = mx.zeros((N, K // group_size), dtype=dtype)
        yield verify_qmm, (mx.zeros((M, K), dtype=dtype), w, groups, groups, group_size, bits)
    for T, Hk, Hv, D in GDN_SHAPES:
        qk, v = mx.zeros((1, T, Hk, D), dtype=dtype), mx.zeros((1, T, Hv, D), dtype=dtype)
        # The gate is float32 as mlx-lm's compute_g gives it; beta is sigmoid(b) in the inputs' dtype.
        gate, beta = mx.zeros((1, T, Hv)), mx.zeros((1, T, Hv), dtype=dtype)
        yield gated_delta_states, (qk, qk, v, gate, beta, mx.zeros((1, Hv, D, D)))
    for N, Hk, Hv, D in GDN_TREE_SHAPES:
        qk, v = mx.zeros((N, Hk, D), dtype=dtype), mx.zeros((N, Hv, D), dtype=dtype)
        gate, beta = mx.zeros((N, Hv)), mx.zeros((N, Hv), dtype=dtype)
        parents = random_parents(N, mx.random.key(0))
        yield gated_delta_tree, (qk, qk, v, gate, beta, mx.zeros((1, Hv, D, D)), parents)


def measure(dtype: mx.Dtype, store: KernelStore) -> list[dict]:
    """Each kernel's verdict at each shape, judged afresh into ``store``."""
    rows = []
    for dispatcher, args in _cases(dtype):
        verdict = dispatcher.with_store(store).verdict(*args)
        rows.append({"kernel": dispatcher.name, "shape": dispatcher.shape_class(*args), **vars(verdict)})
    return rows


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="The inputs' dtype.")
    parser.add_argument("--save", action="store_true", help="Keep the verdicts where generation reads them.")
    parser.add_argument("--json", action="store_true", help="Print a JSON list instead of lines.")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = setup_arg_parser().parse_args(argv)
    if not on_metal():
        sys.exit("No Metal device: kernels run only on an Apple GPU; here their MLX-ops twins run.")
    with tempfile.TemporaryDirectory() as tmp:
        store = KernelStore() if args.save else KernelStore(Path(tmp) / "kernels.json")
        rows = measure(DTYPES[args.dtype], store)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['kernel']:18s} {row['shape']:40s} {'on ' if row['enabled'] else 'off'}  {row['reason']}")


if __name__ == "__main__":
    main()
