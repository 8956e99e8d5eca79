"""The self-checking dispatcher, with fake kernels and a fake clock: a kernel runs only where it
matched its twin and was faster, the verdict is kept per machine, MLX version and shape class,
and off Metal the twin always runs."""

import json
import logging

import mlx.core as mx
import pytest

from dflash_mlx.base.errors import DFlashError
from dflash_mlx.kernels import accept, gdn, gdn_tree, qmm
from dflash_mlx.kernels.dispatch import KERNEL_MODES, KernelStore, SelfChecked, Verdict, check_kernels, on_metal


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fake:
    """A callable that takes ``cost`` fake seconds and adds ``error`` to the right answer."""

    def __init__(self, clock: FakeClock, cost: float, error: float = 0.0, fails: bool = False):
        self.clock, self.cost, self.error, self.fails, self.calls = clock, cost, error, fails, 0

    def __call__(self, x: mx.array) -> mx.array:
        self.calls += 1
        if self.fails:
            raise RuntimeError("Unable to build metal library")
        self.clock.now += self.cost
        return x * 2 + self.error


def _dispatcher(kernel, twin, clock, path, *, metal=True, machine="Apple M3 (arm64)"):
    return SelfChecked(
        "double",
        kernel,
        twin,
        shape_class=lambda x: f"{x.dtype}|{x.shape[0]}",
        example=lambda x: (mx.random.normal(x.shape).astype(x.dtype),),
        close=lambda a, b: mx.allclose(a, b).item(),
        store=KernelStore(path),
        clock=clock,
        metal=metal,
        machine=machine,
        repeats=3,
    )


@pytest.fixture
def clock():
    return FakeClock()


def test_correct_and_faster_kernel_is_enabled_and_kept(clock, tmp_path):
    kernel, twin = Fake(clock, 1.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json")
    x = mx.ones((4,))
    assert d(x).tolist() == [2.0] * 4
    verdict = d.verdict(x)
    assert verdict.enabled and verdict.kernel_s == 1.0 and verdict.twin_s == 2.0
    kernel.calls = twin.calls = 0
    d(x)
    assert (kernel.calls, twin.calls) == (1, 0)
    saved = json.loads((tmp_path / "k.json").read_text())
    key = f"Apple M3 (arm64)|mlx {mx.__version__}|double|mlx.core.float32|4"
    assert saved[key]["enabled"] is True
    # A new process reads the verdict instead of measuring again.
    kernel2, twin2 = Fake(clock, 1.0), Fake(clock, 2.0)
    _dispatcher(kernel2, twin2, clock, tmp_path / "k.json")(x)
    assert (kernel2.calls, twin2.calls) == (1, 0)


def test_wrong_kernel_is_not_used(clock, tmp_path, caplog):
    kernel, twin = Fake(clock, 1.0, error=0.5), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json")
    with caplog.at_level(logging.INFO, logger="dflash_mlx.kernels.dispatch"):
        assert d(mx.ones((4,))).tolist() == [2.0] * 4
        d(mx.ones((4,)))
    assert d.verdict(mx.ones((4,))) == Verdict(False, "differs from its twin")
    assert len(caplog.records) == 1 and "double" in caplog.text and "differs" in caplog.text
    kernel.calls = 0
    d(mx.ones((4,)))
    assert kernel.calls == 0


def test_slower_kernel_is_not_used(clock, tmp_path):
    kernel, twin = Fake(clock, 3.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json")
    d(mx.ones((4,)))
    verdict = d.verdict(mx.ones((4,)))
    assert not verdict.enabled and verdict.reason.startswith("slower")
    kernel.calls = 0
    d(mx.ones((4,)))
    assert kernel.calls == 0


def test_kernel_that_fails_to_build_is_not_used(clock, tmp_path):
    kernel, twin = Fake(clock, 1.0, fails=True), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json")
    assert d(mx.ones((4,))).tolist() == [2.0] * 4
    assert "Unable to build metal library" in d.verdict(mx.ones((4,))).reason


def test_off_metal_the_twin_runs_unchecked(clock, tmp_path):
    kernel, twin = Fake(clock, 1.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json", metal=False)
    assert d(mx.ones((4,))).tolist() == [2.0] * 4
    assert kernel.calls == 0 and not (tmp_path / "k.json").exists()


def test_mode_off_runs_the_twin(clock, tmp_path):
    kernel, twin = Fake(clock, 1.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json")
    d(mx.ones((4,)), mode="off")
    assert kernel.calls == 0 and not (tmp_path / "k.json").exists()


def test_mode_on_runs_a_slower_kernel_untimed_and_keeps_nothing(clock, tmp_path):
    kernel, twin = Fake(clock, 3.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json")
    assert d(mx.ones((4,)), mode="on").tolist() == [2.0] * 4
    assert (kernel.calls, twin.calls) == (2, 1)  # one comparison on random inputs, then the call
    d(mx.ones((4,)), mode="on")
    assert (kernel.calls, twin.calls) == (3, 1)  # compared once per shape class
    d(mx.ones((8,)), mode="on")
    assert (kernel.calls, twin.calls) == (5, 2)
    assert d.forced == {"mlx.core.float32|4", "mlx.core.float32|8"} and d.verdicts == {}
    assert not (tmp_path / "k.json").exists()


@pytest.mark.parametrize(
    "kernel_kind, reason",
    [("differs", "differs from its twin"), ("fails", r"failed \(RuntimeError: Unable to build metal library\)")],
)
def test_mode_on_refuses_a_kernel_that_fails_its_comparison(clock, tmp_path, kernel_kind, reason):
    # Forcing a kernel measures it; it never trades a wrong token for speed, nor falls back quietly.
    kernel = Fake(clock, 1.0, error=0.5) if kernel_kind == "differs" else Fake(clock, 1.0, fails=True)
    d = _dispatcher(kernel, Fake(clock, 2.0), clock, tmp_path / "k.json")
    message = f"Kernel double at mlx.core.float32\\|4: {reason}, so kernels 'on' cannot run it. Use 'auto'"
    with pytest.raises(DFlashError, match=message):
        d(mx.ones((4,)), mode="on")
    assert d.forced == set()


def test_mode_on_off_metal_runs_the_twin(clock, tmp_path):
    kernel, twin = Fake(clock, 1.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json", metal=False)
    d(mx.ones((4,)), mode="on")
    assert kernel.calls == 0


def test_check_kernels():
    assert [check_kernels(m, metal=True) for m in KERNEL_MODES] == ["auto", "on", "off"]
    assert check_kernels("auto", metal=False) == "auto" and check_kernels("off", metal=False) == "off"
    with pytest.raises(DFlashError, match=r"kernels 'on' needs a Metal device .*Use 'auto' \(the default\) or 'off'"):
        check_kernels("on", metal=False)
    with pytest.raises(DFlashError, match="kernels must be one of auto, on, off \\(got 'yes'\\)"):
        check_kernels("yes", metal=True)


def test_each_shape_class_machine_and_mlx_version_is_judged_apart(clock, tmp_path):
    kernel, twin = Fake(clock, 1.0), Fake(clock, 2.0)
    path = tmp_path / "k.json"
    d = _dispatcher(kernel, twin, clock, path)
    d(mx.ones((4,)))
    d(mx.ones((8,)))
    _dispatcher(kernel, twin, clock, path, machine="Apple M1 (arm64)")(mx.ones((4,)))
    saved = json.loads(path.read_text())
    assert len(saved) == 3
    # A verdict from another MLX version is not this one's.
    other = {k.replace(f"mlx {mx.__version__}", "mlx 0.0.1"): v for k, v in saved.items()}
    path.write_text(json.dumps(other))
    kernel.calls = 0
    _dispatcher(kernel, twin, clock, path)(mx.ones((4,)))
    assert kernel.calls > 1  # checked and timed again


def test_unreadable_store_is_measured_again(clock, tmp_path):
    path = tmp_path / "k.json"
    path.write_text("{not json")
    kernel, twin = Fake(clock, 1.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, path)
    d(mx.ones((4,)))
    assert d.verdict(mx.ones((4,))).enabled
    path.write_text(json.dumps({d.key("mlx.core.float32|4"): {"enabled": "yes"}}))
    assert _dispatcher(kernel, twin, clock, path).verdict(mx.ones((4,))).enabled


def test_unsupported_inputs_go_to_the_twin_unchecked(clock, tmp_path):
    kernel, twin = Fake(clock, 1.0), Fake(clock, 2.0)
    d = _dispatcher(kernel, twin, clock, tmp_path / "k.json")
    d.supports = lambda x: x.shape[0] <= 4
    d(mx.ones((5,)))
    assert kernel.calls == 0 and not (tmp_path / "k.json").exists()


@pytest.mark.skipif(on_metal(), reason="off Metal only (on a Mac the dispatchers would check themselves)")
def test_real_dispatchers_run_their_twins_here():
    # Off Metal (this suite's CPU backend), the library's dispatchers are their twins.
    logits = mx.random.normal((4, 50))
    drafts = mx.argmax(logits, axis=-1)[:-1]
    assert accept.greedy_accept(logits, drafts).tolist() == accept.greedy_accept_ops(logits, drafts).tolist()
    w, s, b = mx.quantize(mx.random.normal((8, 64)), group_size=32, bits=4)
    x = mx.random.normal((3, 64))
    assert mx.array_equal(qmm.verify_qmm(x, w, s, b, 32, 4), qmm.verify_qmm_ops(x, w, s, b, 32, 4)).item()
    args = _recurrence_inputs()
    got, want = gdn.gated_delta_states(*args), gdn.gated_delta_states_ops(*args)
    for a, b in zip(got[:2] + tuple(got[2]), want[:2] + tuple(want[2])):
        assert mx.array_equal(a, b).item()
    args = _tree_inputs()
    got, want = gdn_tree.gated_delta_tree(*args), gdn_tree.gated_delta_tree_ops(*args)
    for a, b in zip((got[0], *got[1]), (want[0], *want[1])):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_greedy_accept_twin_every_acceptance_length(rows):
    for n in range(rows):
        logits = mx.random.normal((rows, 40))
        target = mx.argmax(logits, axis=-1).astype(mx.int32)
        drafts = mx.where(mx.arange(rows - 1) < n, target[:-1], (target[:-1] + 7) % 40)
        assert accept.greedy_accept_ops(logits, drafts).tolist() == [n, target[n].item()]


def test_measure_cli(capsys):
    from dflash_mlx.kernels import measure

    with pytest.raises(SystemExit):
        measure.main(["--help"])
    assert "--save" in capsys.readouterr().out
    if not on_metal():
        with pytest.raises(SystemExit, match="No Metal device"):
            measure.main([])


def test_kernel_that_cannot_run_here_falls_back(tmp_path):
    # The real kernel on MLX's CPU backend: mx.fast.metal_kernel refuses, the verdict says so.
    if on_metal():
        pytest.skip("off Metal only")
    d = accept.greedy_accept.with_store(KernelStore(tmp_path / "k.json"))
    d._metal = True
    logits = mx.random.normal((4, 50))
    drafts = mx.argmax(logits, axis=-1)[:-1]
    assert d(logits, drafts).tolist() == accept.greedy_accept_ops(logits, drafts).tolist()
    assert d.verdict(logits, drafts).reason.startswith("failed")


def test_checks_leave_the_random_state_alone():
    logits = mx.zeros((4, 50))
    w, s, b = mx.quantize(mx.zeros((8, 64)), group_size=32, bits=4)
    mx.random.seed(5)
    want = mx.random.uniform(shape=(3,)).tolist()
    mx.random.seed(5)
    accept.greedy_accept.example(logits, mx.zeros((3,), dtype=mx.int32))
    qmm.verify_qmm.example(mx.zeros((2, 64)), w, s, b, 32, 4)
    gdn.gated_delta_states.example(*_recurrence_inputs())
    gdn_tree.gated_delta_tree.example(*_tree_inputs())
    assert mx.random.uniform(shape=(3,)).tolist() == want


def _recurrence_inputs() -> tuple:
    q = mx.zeros((1, 4, 2, 16))
    return gdn.gated_delta_states.example(q, q, mx.zeros((1, 4, 4, 8)), mx.zeros((1, 4, 4)), mx.zeros((1, 4, 4)),
                                          mx.zeros((1, 4, 8, 16)))  # fmt: skip


def _tree_inputs(n: int = 6) -> tuple:
    q = mx.zeros((n, 2, 16))
    return gdn_tree.gated_delta_tree.example(q, q, mx.zeros((n, 4, 8)), mx.zeros((n, 4)), mx.zeros((n, 4)),
                                             mx.zeros((1, 4, 8, 16)), list(range(-1, n - 1)))  # fmt: skip


def test_gated_delta_tree_example_is_a_branching_tree_of_the_same_class():
    # The check a Mac runs per shape class must read parents that are not the node before.
    args = _tree_inputs(17)
    like = (mx.zeros((17, 2, 16)),) * 2 + (mx.zeros((17, 4, 8)), mx.zeros((17, 4)), mx.zeros((17, 4)))
    assert gdn_tree.shape_class(*args) == gdn_tree.shape_class(*like, mx.zeros((1, 4, 8, 16)), [-1] * 17)
    assert gdn_tree.supports(*args)
    parents = args[-1]
    assert any(p != i - 1 for i, p in enumerate(parents)) and any(p == i - 1 for i, p in enumerate(parents[1:], 1))


def test_gated_delta_states_twin_keeps_every_position():
    # The state after position t is the final state of the pass cut after t.
    q, k, v, g, beta, state = _recurrence_inputs()
    y, final, states = gdn.gated_delta_states_ops(q, k, v, g, beta, state)
    assert [s.shape for s in states] == [(1, 4, 8, 16)] * 4 and y.shape == (1, 4, 4, 8)
    assert mx.array_equal(states[-1], final).item()
    for t in range(4):
        _, cut, _ = gdn.gated_delta_states_ops(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1],
                                               beta[:, : t + 1], state)  # fmt: skip
        assert mx.array_equal(states[t], cut).item()


def test_gated_delta_states_twin_is_mlx_lms_recurrence():
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta, state = _recurrence_inputs()
    y, final, _ = gdn.gated_delta_states_ops(q, k, v, g, beta, state)
    want_y, want_state = gated_delta_ops(q, k, v, g, beta, state)
    assert mx.array_equal(y, want_y).item() and mx.array_equal(final, want_state).item()
