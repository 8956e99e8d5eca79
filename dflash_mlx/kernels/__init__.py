"""Metal kernels for Apple GPUs, each with its MLX-ops twin (the truth) and a dispatcher.

A kernel runs only on a Metal device and only at a shape class where it has checked itself
against its twin and was faster (``dispatch``); everywhere else the twin runs. A ``kernels``
argument (``"auto"``, ``"on"``, ``"off"``) passed down to each call can force them on or off. ``harness`` runs
a kernel's Metal source on a CPU, which is how the tests check it off a Mac."""

from .accept import greedy_accept, greedy_accept_ops
from .dispatch import KERNEL_MODES, KernelStore, SelfChecked, Verdict, check_kernels
from .gdn import gated_delta_states, gated_delta_states_ops
from .gdn_tree import gated_delta_tree, gated_delta_tree_ops
from .qmm import verify_qmm, verify_qmm_ops

# Every kernel's dispatcher, for reports.
DISPATCHERS = (greedy_accept, verify_qmm, gated_delta_states, gated_delta_tree)

__all__ = [
    "DISPATCHERS",
    "KERNEL_MODES",
    "KernelStore",
    "SelfChecked",
    "Verdict",
    "check_kernels",
    "gated_delta_states",
    "gated_delta_states_ops",
    "gated_delta_tree",
    "gated_delta_tree_ops",
    "greedy_accept",
    "greedy_accept_ops",
    "verify_qmm",
    "verify_qmm_ops",
]
