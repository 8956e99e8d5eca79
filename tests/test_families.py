"""The battery every target family passes on its tiny pairs, written by transformers in their published layouts:
DFlash's greedy output is mlx-lm's own greedy decoding with a random drafter at every block size, through every
acceptance length, across a stop token inside a block and through draft trees, and the taps folded as they are made
equal the drafter's ``fc`` of the taps. The checks are in helpers/family.py; what is one family's alone stays in its
own module (test_gemma4, test_gpt_oss, test_kimi, test_hybrid)."""

from dataclasses import dataclass

import pytest
from helpers import family
from helpers.hf_checkpoints import GEMMA_KINDS, HF_KINDS

from dflash_mlx import load

torch = pytest.importorskip("torch")

HYBRID = [k for k in HF_KINDS if k != "qwen3_moe"]


@dataclass(frozen=True)
class Family:
    kinds: tuple[str, ...]
    block_sizes: tuple[int, ...] = (2, 4, 8, 16)
    prompt_lens: tuple[int, ...] = (1, 7, 40)  # past the sliding window, where a family has one
    acceptance_sizes: tuple[int, ...] = (2, 5, 16)
    stop: dict | None = None  # check_stop_mid_block_then_continue's settings (None: its defaults)
    stop_kinds: tuple[str, ...] | None = None  # the kinds it runs on (None: every kind)
    sliding: bool = False  # sliding-window layers: caches that drop old positions within these short runs


FAMILIES = {
    "gemma4": Family(tuple(GEMMA_KINDS), sliding=True),
    "gpt_oss": Family(("gpt_oss",), prompt_lens=(1, 5, 40), stop={"prompt_len": 9, "with_plain": True}, sliding=True),
    "kimi": Family(("kimi_k25",), block_sizes=(2, 5, 16), stop={"prompt_len": 9}),
    # Longer prompts than the others': several of the recurrent kernel's chunks.
    "hybrid": Family(tuple(HF_KINDS), prompt_lens=(1, 7, 130), stop_kinds=tuple(HYBRID)),
}


def _write(name: str, root):
    if name == "gemma4":
        return family.write_targets(root, GEMMA_KINDS, draft=family.gemma_draft_config())
    if name == "hybrid":
        return family.write_targets(root, HF_KINDS)
    target, hf, draft = family.write_pair_folders(root, FAMILIES[name].kinds[0])
    return {FAMILIES[name].kinds[0]: (target, hf), "draft": (draft, None)}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(family)``: ``{kind: (model, draft, tokenizer)}``, each family's written and loaded once."""
    built = {}

    def get(name: str) -> dict:
        if name not in built:
            folders = _write(name, tmp_path_factory.mktemp(name))
            built[name] = {kind: load(folders[kind][0], folders["draft"][0]) for kind in FAMILIES[name].kinds}
        return built[name]

    return get


def cases(*fields: str, kinds: str = "kinds") -> list:
    """One param per family, kind and combination of the family's ``fields`` (block sizes, prompt lengths)."""
    out = []
    for name, f in FAMILIES.items():
        combos = [()]
        for field in fields:
            combos = [(*c, v) for c in combos for v in getattr(f, field)]
        for kind in getattr(f, kinds) or f.kinds:
            out += [pytest.param(name, kind, *c, id="-".join(map(str, (name, kind, *c)))) for c in combos]
    return out


@pytest.fixture(autouse=True)
def _sliding(request, monkeypatch):
    if FAMILIES[request.node.callspec.params["name"]].sliding:
        family.small_sliding_caches(monkeypatch)


@pytest.mark.parametrize("name, kind, block_size, prompt_len", cases("block_sizes", "prompt_lens"))
def test_lossless_random_drafter(pairs, name, kind, block_size, prompt_len):
    model, draft, _ = pairs(name)[kind]
    family.check_lossless(model, draft, block_size, prompt_len)


@pytest.mark.parametrize("name, kind, block_size", cases("acceptance_sizes"))
def test_every_acceptance_length(pairs, name, kind, block_size):
    model, draft, _ = pairs(name)[kind]
    family.check_every_acceptance_length(model, draft, block_size)


@pytest.mark.parametrize("name, kind", cases(kinds="stop_kinds"))
def test_stop_tokens_mid_block_then_continue(pairs, name, kind):
    model, draft, _ = pairs(name)[kind]
    family.check_stop_mid_block_then_continue(model, draft, **(FAMILIES[name].stop or {}))


@pytest.mark.parametrize("name, kind", cases())
def test_taps_folded_as_made_equal_fc_of_the_taps(pairs, name, kind):
    family.check_folded_taps(pairs(name)[kind][0])


@pytest.mark.parametrize("name, kind", cases())
def test_draft_trees_are_lossless(pairs, name, kind):
    """Trees through each family's layers: sliding windows (each node sees the window back from its own position),
    layers that reuse an earlier one's keys, latent attention (a boolean mask folded into its RoPE scores), MoE
    experts (a batch of nodes routed row by row), Gated DeltaNet (each node's state continues its own path, forked
    at every branch; a cut inside the accepted path rolls back along it)."""
    family.check_tree_lossless(*pairs(name)[kind][:2])


@pytest.mark.parametrize("name, kind", cases())
def test_draft_trees_with_a_draft_vocab(pairs, name, kind):
    family.check_tree_with_draft_vocab(*pairs(name)[kind][:2])


@pytest.mark.parametrize("name, kind", [c for c in cases() if FAMILIES[c.values[0]].sliding])
def test_draft_trees_past_the_sliding_buffer(pairs, name, kind, monkeypatch):
    family.check_tree_past_the_sliding_buffer(*pairs(name)[kind][:2], monkeypatch)


@pytest.mark.parametrize("name, kind", cases())
def test_the_targets_say_varied_text(pairs, name, kind):
    """The tree and rollback checks need text that depends on its context (helpers/varied.py)."""
    from helpers.varied import is_varied, variety

    assert is_varied(pairs(name)[kind][0]), variety(pairs(name)[kind][0])
