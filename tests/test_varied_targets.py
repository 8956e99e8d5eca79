"""The tiny targets that the tree and datastore tests run on say varied text: the recorded criterion
(helpers/varied.py) holds for each, and it sees the runs of a target that repeats itself. (The hybrid
targets' own check is in test_hybrid.py, where they are built.)"""

from helpers.checkpoints import write_target
from helpers.varied import MAX_RUN, MIN_DISTINCT, is_varied, longest_run, variety

from dflash_mlx import load


def test_longest_run():
    assert [longest_run(t) for t in ([], [1], [1, 2, 3], [4, 4, 1, 4, 4, 4, 2])] == [0, 1, 1, 3]


def test_every_varied_fixture_meets_the_criterion(varied_pair):
    model = varied_pair[0]
    assert is_varied(model), (variety(model), MIN_DISTINCT, MAX_RUN)


def test_the_criterion_sees_a_target_that_repeats_itself(tmp_path):
    """Negative control: the default tied random target's greedy text is one token over and over."""
    write_target(tmp_path / "t", kind="qwen3", tied=True)
    model = load(tmp_path / "t")[0]
    assert not is_varied(model)
    assert min(d for d, _ in variety(model)) < MIN_DISTINCT
