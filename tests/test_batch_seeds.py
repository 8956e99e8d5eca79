"""A seeded request draws from its own generator: its sampled reply is the same whatever else is in the batch."""

import mlx.core as mx
import pytest
from test_batch import LIMITS, PROMPTS, _drain
from test_sampling import PROMPT
from test_sampling import pair as pair  # noqa: F401 (a target whose sampling has real choices)

from dflash_mlx import LoopOptions, make_cache
from dflash_mlx.generation import batch_engine, batch_request
from dflash_mlx.sampling import make_sampler


def _seeded(model, draft, engine, seed, proposal):
    options = LoopOptions(max_tokens=30, block_size=6, sampler=make_sampler(1.0), seed=seed, proposal=proposal)
    return engine.add(batch_request(model, draft, PROMPT, options), lambda: make_cache(model, draft))


def _other(model, draft, engine, i, sampled):
    options = LoopOptions(max_tokens=LIMITS[i], block_size=4, sampler=make_sampler(0.8) if sampled else None)
    return engine.add(batch_request(model, draft, PROMPTS[i], options), lambda: make_cache(model, draft))


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_a_seeded_reply_is_the_same_alone_and_in_any_batch(pair, proposal):  # noqa: F811
    model, draft, _ = pair
    engine = batch_engine(model, draft, max_batch=1)
    alone = _seeded(model, draft, engine, 7, proposal)
    out, _ = _drain(engine, [alone])
    reference = out[alone]
    assert len(reference) == 30

    # Beside others, joining first, then after others already run and draw from the shared generator.
    for order in ("first", "later"):
        mx.random.seed(123 if order == "first" else 456)  # whatever the rest of the process draws
        engine = batch_engine(model, draft, max_batch=4, prefill_step_size=8)
        ids = []
        if order == "first":
            ids.append(_seeded(model, draft, engine, 7, proposal))
        ids += [_other(model, draft, engine, i, sampled=i % 2 == 0) for i in (0, 2, 3)]
        if order == "later":
            for _ in range(3):
                engine.step()
            ids.append(_seeded(model, draft, engine, 7, proposal))
        seeded = ids[0] if order == "first" else ids[-1]
        out, _ = _drain(engine, ids)
        assert out[seeded] == reference, order

    engine = batch_engine(model, draft, max_batch=1)
    other = _seeded(model, draft, engine, 8, proposal)
    out, _ = _drain(engine, [other])
    assert out[other] != reference  # the seed decides the reply


def test_the_batching_server_honours_a_requests_seed(pair):  # noqa: F811
    """Two requests with one seed sent together get the reply the seed gives alone; another seed, another."""
    import threading

    from test_server import _post

    from dflash_mlx.tools.server.app import DFlashServer

    model, draft, tokenizer = pair
    srv = DFlashServer(model, draft, tokenizer, model_name="tiny", port=0, max_batch=4).start()

    def ask(seed):
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": seed}
        status, full, _ = _post(srv.url, "/v1/completions", body)
        return full["choices"][0]["text"] if status == 200 else f"HTTP {status}"

    try:
        alone = ask(5)
        together = [None] * 3
        threads = [
            threading.Thread(target=lambda j=j: together.__setitem__(j, ask(5 if j < 2 else 6))) for j in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together[:2] == [alone, alone]
        assert together[2] != alone
    finally:
        srv.close()
