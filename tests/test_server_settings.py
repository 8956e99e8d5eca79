"""dflash-serve's two workers decode a request with the same settings: every field that decoding reads
reaches the one-at-a-time worker's stream and the batching worker's ``LoopOptions`` alike."""

import dataclasses
import json

import mlx.core as mx

from dflash_mlx import LoopOptions
from dflash_mlx.tools.server import batch_worker
from dflash_mlx.tools.server.batch_worker import BatchWorker
from dflash_mlx.tools.server.protocol import CHAT, TEXT, CompletionRequest
from dflash_mlx.tools.server.worker import Job, Worker

# Fields that decoding does not read: the prompt (tokenized before a worker runs), the reply's shape, stop
# strings (each worker cuts its text itself) and bookkeeping.
NOT_DECODING = {"model", "messages", "prompt", "stream", "include_usage", "stop", "template_args", "id", "created"}
# Every other field, each set to a value other than its default.
DECODING = {
    "kind": CHAT,
    "max_tokens": 7,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "repetition_penalty": 1.3,
    "seed": 11,
    "block_size": 3,
    "min_confidence": 0.2,
    "confidence_threshold": 0.4,
    "lookup_fallback": 2,
    "tree_budget": 4,
}
IDS = [1, 2, 3, 4]
# What each worker adds of its own, rather than from the request.
OWN = {"policy", "datastore", "stop_tokens"}


def _view(session, options: LoopOptions, parse_reasoning: bool) -> dict:
    """What a worker decodes a request with: the loop's options, its policy state's setup, its reasoning split."""
    view = {f.name: getattr(options, f.name) for f in dataclasses.fields(LoopOptions) if f.name not in OWN}
    tokens, logits = mx.array([1, 2, 3]), mx.arange(8, dtype=mx.float32)[None]
    view["logits_processors"] = [p(tokens, logits).tolist() for p in options.logits_processors or []]
    view["setup"] = [json.loads(name) for name, state in session.policies.items() if state is options.policy]
    view["parse_reasoning"] = parse_reasoning
    return view


def _worker_view(worker: Worker, req: CompletionRequest, monkeypatch) -> dict:
    seen = {}

    def stream(prompt, *, setup=None, **kwargs):
        seen.update(kwargs, setup=setup)
        return (r for r in ())

    monkeypatch.setattr(worker.session, "stream", stream)
    worker._run(Job(req, IDS))
    # As stream_generate makes the loop's options from its keyword arguments.
    options = LoopOptions(**{k: v for k, v in seen.items() if k not in ("prompt_cache", "parse_reasoning", "setup")})
    options = dataclasses.replace(options, policy=worker.session.policy(seen["setup"]))
    return _view(worker.session, options, seen["parse_reasoning"])


def _batch_view(batch: BatchWorker, req: CompletionRequest, monkeypatch) -> dict:
    seen, parsed = [], []
    real = batch_worker.batch_request

    def batch_request(model, draft, ids, options, **kwargs):
        seen.append(options)
        return real(model, draft, ids, options, **kwargs)

    monkeypatch.setattr(batch_worker, "batch_request", batch_request)
    monkeypatch.setattr(batch_worker, "reasoning_parser", lambda tokenizer, ids: parsed.append(ids))
    monkeypatch.setattr(batch.engine, "add", lambda request, _: len(seen))  # the row never runs
    batch._admit(Job(req, IDS))
    del batch.flights[len(seen)]
    return _view(batch.session, seen[-1], bool(parsed))


def test_every_decoding_field_of_a_request_reaches_both_workers_alike(qwen3_pair, monkeypatch):
    fields = {f.name for f in dataclasses.fields(CompletionRequest)}
    assert fields == NOT_DECODING | set(DECODING), "a new request field: add it to DECODING or NOT_DECODING"
    model, draft, tokenizer = qwen3_pair
    worker, batch = Worker(model, draft, tokenizer), BatchWorker(model, draft, tokenizer, max_batch=2)
    try:
        base = CompletionRequest(kind=TEXT, model="tiny")
        plain = _worker_view(worker, base, monkeypatch)
        assert _batch_view(batch, base, monkeypatch) == plain
        for name, value in DECODING.items():
            req = dataclasses.replace(base, **{name: value})
            one, other = _worker_view(worker, req, monkeypatch), _batch_view(batch, req, monkeypatch)
            assert one != plain, f"{name} does not reach the one-at-a-time worker"
            assert other != plain, f"{name} does not reach the batching worker"
            assert one == other, f"{name} reaches the two workers differently"
    finally:
        worker.close()
        batch.close()
