"""A request's decoding settings, built in one place for both of dflash-serve's workers.

:func:`generation_settings` turns a checked request into plain values (JSON: rank 0 of a sharded target
sends them to the other ranks as they are); :func:`loop_settings` turns those into the loop's keyword
arguments, which the one-at-a-time worker passes to ``Session.stream`` and the batching worker to
``LoopOptions``. What each worker adds of its own (the cache, the policy state, stop tokens, the datastore)
stays with it. A request field that decoding reads goes into :func:`generation_settings` and, where the loop
takes it, into :func:`loop_settings`, and so reaches both workers.
"""

from mlx_lm.sample_utils import make_logits_processors

from ...sampling import make_sampler
from ...text.chat_template import has_chat_template
from .protocol import CHAT, CompletionRequest


def generation_settings(req: CompletionRequest, ids: list[int], *, has_draft: bool, tokenizer) -> dict:
    """The plain settings that decode ``req`` from its prompt ``ids``.

    Args:
        req: The checked request.
        ids: Its prompt's token ids.
        has_draft: Whether the server has a drafter: without one, the request's block size and draft
          tree ask for nothing (plain decoding).
        tokenizer: The target's tokenizer: a chat reply's reasoning is parsed where it has a chat template.

    Returns:
        dict: JSON values only: the prompt ``ids``, the sampling settings, the drafting settings,
        ``seed`` and ``parse_reasoning``.
    """
    return {
        "ids": ids,
        "max_tokens": req.max_tokens,
        "block_size": req.block_size if has_draft else None,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "top_k": req.top_k,
        "repetition_penalty": req.repetition_penalty,
        "min_confidence": req.min_confidence,
        "confidence_threshold": req.confidence_threshold,
        "lookup_fallback": req.lookup_fallback,
        "tree_budget": req.tree_budget if has_draft else 0,
        "seed": req.seed,
        "parse_reasoning": req.kind == CHAT and has_chat_template(tokenizer),
    }


def policy_setup(generation: dict) -> dict:
    """The drafting setup whose adaptive policy state a request goes on from (``Session.policy``): what the
    policy's verdict depends on, so that requests that draft alike share what it learned."""
    g = generation
    setup = (g["block_size"], g["temperature"] > 0, g["min_confidence"], g["lookup_fallback"], g["tree_budget"],
             g["confidence_threshold"])  # fmt: skip
    return {"serve": list(setup)}


def num_spec_tokens(generation: dict, max_block_size: int) -> int:
    """The drafts a cycle verifies at most, for the response's statistics (``"auto"``: up to the drafter's
    block size ``max_block_size``)."""
    block_size = generation["block_size"]
    return (block_size if isinstance(block_size, int) else max_block_size) - 1


def loop_settings(generation: dict) -> dict:
    """The loop's keyword arguments (``LoopOptions`` fields) for plain ``generation`` settings: the sampler,
    the logits processors and the drafting settings. Raises ``DFlashError`` for a bad sampling setting."""
    g = generation
    penalty = g["repetition_penalty"]
    return {
        "max_tokens": g["max_tokens"],
        "block_size": g["block_size"],
        "tree_budget": g["tree_budget"],
        "sampler": make_sampler(g["temperature"], g["top_p"], g["min_p"], g["top_k"]),
        "logits_processors": make_logits_processors(repetition_penalty=penalty) if penalty else None,
        "min_confidence": g["min_confidence"],
        "confidence_threshold": g["confidence_threshold"],
        "lookup_fallback": g["lookup_fallback"],
        "seed": g["seed"],
    }
