"""The width of a batched pass: the one cut of every row's proposal that gives the most expected tokens a second."""

from dflash_mlx.tuning.batch import BatchCosts, RowAcceptance


def _costs(first: float, each: float) -> BatchCosts:
    # Passes timed at every size the engine may try: ``first`` seconds for one token, ``each`` per further one.
    costs = BatchCosts()
    for rows in (1, 2, 4):
        for width in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16):
            for _ in range(30):
                costs.timed(rows, width, first + each * (rows * width - 1))
    return costs


def _rows(chance: float, n: int) -> list[RowAcceptance]:
    return [RowAcceptance(right=chance * 100, tried=100.0) for _ in range(n)]


def test_rows_that_proposed_nothing_take_a_plain_step():
    assert _costs(0.06, 0.005).width(_rows(0.9, 2), [0, 0]) == 1


def test_the_width_never_passes_the_longest_proposal():
    assert _costs(0.06, 0.0).width(_rows(0.99, 2), [3, 1]) == 4


def test_good_drafts_are_verified_while_each_token_is_cheap_and_cut_when_it_is_dear():
    cheap, dear = _costs(0.06, 0.001), _costs(0.06, 0.05)
    assert cheap.width(_rows(0.8, 2), [15, 15]) >= 8
    assert dear.width(_rows(0.8, 4), [15, 15, 15, 15]) <= 2
    # Poor drafts are not worth a wider pass even where tokens are cheap.
    assert cheap.width(_rows(0.05, 4), [15, 15, 15, 15]) <= 2


def test_a_row_without_drafts_gains_nothing_from_the_width_it_pays_for():
    # Every row of the pass is as wide as the widest: one row's drafts alone pay for a narrower pass than
    # everyone's drafts do.
    costs = _costs(0.06, 0.003)
    alone = costs.width(_rows(0.8, 4), [15, 0, 0, 0])
    everyone = costs.width(_rows(0.8, 4), [15, 15, 15, 15])
    assert 1 < alone < everyone


def test_a_fast_model_timed_only_at_narrow_widths_still_tries_wide_ones():
    # A model 30 times as fast as the prior's: until other sizes are timed, wider passes are priced at the same
    # shape scaled down, so good drafts are verified wide (a prior in seconds kept such a model at width 2).
    costs = BatchCosts()
    for _ in range(30):
        costs.timed(2, 2, 0.002)
    assert costs.width(_rows(0.9, 2), [7, 7]) >= 6
    assert costs.seconds(2, 8) < 0.01
