"""Tiny targets whose greedy text depends on its context: varied tokens, no long runs of one.

A target that says one token thirty times hides most bugs of a speculative loop: a corrupted cache, a
shifted query or the wrong branch's keys still draft and verify that token. The tests of draft trees,
hybrid trees and the datastore run on targets chosen by :func:`is_varied`, a recorded criterion that
``tests/test_varied_targets.py`` checks on every such fixture (so that none slides back into runs).
"""

from pathlib import Path

from .checkpoints import write_target
from .family import prompt_ids, reference

# Over 32 greedy tokens after each check prompt: at least this many distinct tokens, and no token
# more than this many times in a row. (The default tied random targets give 1 and 32.)
MIN_DISTINCT = 12
MAX_RUN = 5
CHECK_PROMPTS = ((1, 3), (9, 3), (30, 3), (9, 5))  # (length, seed) of family.prompt_ids
CHECK_TOKENS = 32
# Each layer's output projections scaled up, so that the layers outweigh the token's own embedding.
LAYER_SCALE = 16.0


def longest_run(tokens: list[int]) -> int:
    """The most times one token comes in a row."""
    best = run = 1 if tokens else 0
    for a, b in zip(tokens, tokens[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


def variety(model) -> list[tuple[int, int]]:
    """``(distinct tokens, longest run)`` of the greedy text after each check prompt."""
    texts = [reference(model, prompt_ids(n, seed=s), CHECK_TOKENS) for n, s in CHECK_PROMPTS]
    return [(len(set(t)), longest_run(t)) for t in texts]


def is_varied(model) -> bool:
    return all(d >= MIN_DISTINCT and r <= MAX_RUN for d, r in variety(model))


def write_varied_target(path: Path, kind: str = "qwen3", tied: bool = True, seeds=range(32)):
    """The first seed's target of ``kind`` that :func:`is_varied` accepts (written at ``path``)."""
    for seed in seeds:
        model = write_target(path, kind=kind, tied=tied, seed=seed, layer_scale=LAYER_SCALE)
        if is_varied(model):
            return model
    raise AssertionError(f"no seed in {seeds} gives a varied {kind} target (tied={tied})")
