"""dflash-serve on loopback: the OpenAI shapes, exactness, bad requests, disconnects, the queue, shutdown."""

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_mlx import generate, load, stream_generate
from dflash_mlx.tools.server.app import DFlashServer, main
from dflash_mlx.tools.server.protocol import Defaults, StopMatcher

PROMPTS = ["t1 t2 t3", "t9 t8 t7 t6", "t40", "t5 t5 t5 t5 t5", "t100 t3", "t17 t18", "t60 t61 t62", "t11"]
MAX_TOKENS = 24


def _chat_ids(tokenizer, text):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


@pytest.fixture(scope="module")
def server(qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    srv = DFlashServer(
        model, draft, tokenizer, model_name="tiny", port=0, queue_size=8, defaults=Defaults(max_tokens=MAX_TOKENS)
    ).start()
    yield srv
    srv.close()


@pytest.fixture
def slow_pair(pair_dirs):
    """A fresh pair whose drafter takes 40 ms a pass, so a request lasts long enough to interrupt."""
    model, draft, tokenizer = load(pair_dirs["qwen3-tied"], pair_dirs["draft"])
    propose = draft.propose

    def slow(*args, **kwargs):
        time.sleep(0.04)
        return propose(*args, **kwargs)

    object.__setattr__(draft, "propose", slow)
    return model, draft, tokenizer


def _request(url, method, path, body=None, headers=None, timeout=30):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def _post(url, path, body, headers=None):
    conn, resp = _request(url, "POST", path, body, headers)
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else None, resp


def _events(resp):
    """The JSON objects of a server-sent event stream, up to [DONE]."""
    out = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return out, True
        out.append(json.loads(line[6:]))
    return out, False


def _stream(url, path, body):
    conn, resp = _request(url, "POST", path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events, done = _events(resp)
    conn.close()
    assert done
    return events


def _stream_text(events, chat=True):
    if chat:
        return "".join(c["choices"][0]["delta"].get("content", "") for c in events if c["choices"])
    return "".join(c["choices"][0]["text"] for c in events if c["choices"])


def test_chat_and_completions_match_generate_streamed_or_not(server, qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    for text in PROMPTS[:2]:
        ids = _chat_ids(tokenizer, text)
        expected = generate(model, draft, tokenizer, ids, max_tokens=MAX_TOKENS)
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "temperature": 0}
        status, full, _ = _post(server.url, "/v1/chat/completions", body)
        assert status == 200 and full["object"] == "chat.completion"
        assert full["choices"][0]["message"] == {"role": "assistant", "content": expected}
        events = _stream(server.url, "/v1/chat/completions", body)
        assert _stream_text(events) == expected
        assert all(e["id"] == events[0]["id"] and e["object"] == "chat.completion.chunk" for e in events)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1]["choices"] == []
        assert events[-1]["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
        # The same prompt again continues its conversation cache: all but one token reused.
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
        spec = events[-1]["metrics"]["speculative_decoding"]
        assert spec["num_spec_steps"] + spec["num_plain_steps"] > 0  # drafting or plain, as the policy chose

        expected = generate(model, draft, tokenizer, text, max_tokens=MAX_TOKENS)
        body = {"prompt": text, "max_tokens": MAX_TOKENS}
        status, full, _ = _post(server.url, "/v1/completions", body)
        assert status == 200 and full["object"] == "text_completion"
        assert full["choices"][0]["text"] == expected
        assert _stream_text(_stream(server.url, "/v1/completions", body), chat=False) == expected


def test_usage_and_speculative_statistics_agree_with_stream_generate(server, qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    ids = _chat_ids(tokenizer, PROMPTS[2])
    # A seed turns the adaptive policy off on both sides: its plain cycles follow timings, so without
    # it the two runs may draft in different cycles (greedy output is the same either way).
    responses = list(stream_generate(model, draft, tokenizer, ids, max_tokens=MAX_TOKENS, seed=0))
    cycles = [r for r in responses if r.cycle > 0 and r.num_draft > 0]
    status, full, _ = _post(
        server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}], "seed": 0}
    )
    assert status == 200
    usage, spec = full["usage"], full["metrics"]["speculative_decoding"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] == responses[-1].generation_tokens
    assert usage["total_tokens"] == len(ids) + responses[-1].generation_tokens
    assert spec["num_spec_steps"] == len(cycles)
    assert spec["num_draft_tokens"] == sum(r.num_draft for r in cycles)
    assert spec["num_accepted_draft_tokens"] == sum(r.acceptance_length - 1 for r in cycles)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / len(cycles))
    assert sum(spec["acceptance_histogram"]) == len(cycles)
    assert len(spec["acceptance_histogram"]) == draft.block_size
    assert spec["num_spec_tokens"] == draft.block_size - 1
    # Same messages again: the conversation cache holds the prompt, so only one token is prefilled.
    status, again, _ = _post(
        server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}]}
    )
    assert again["choices"] == full["choices"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1


def test_the_worker_keeps_what_the_adaptive_policy_learned_across_requests(qwen3_pair, monkeypatch):
    """A drafter that loses (each pass costs 3 s on the policy's clock, no draft is right): only
    the first request drafts, in its warm-up and one judged window (cut short after three
    cycles); later requests decode plainly
    from their first cycle, and their statistics say so."""
    from functools import partialmethod

    from helpers.policy import Clock, CostlyDraft

    from dflash_mlx.tools.server.protocol import TEXT, CompletionRequest
    from dflash_mlx.tools.server.worker import Job, Worker
    from dflash_mlx.tuning.policy import PolicyState

    model, draft, tokenizer = qwen3_pair
    clock = Clock(step=1.0)
    # Paused cycles as plain steps (no lookup drafts), so that the plain counts tell them apart.
    monkeypatch.setattr(PolicyState, "__init__", partialmethod(PolicyState.__init__, clock=clock, lookup=0))
    worker = Worker(model, CostlyDraft(draft, [], clock, 3.0, wrong_every=1), tokenizer)
    specs = []
    for prompt in PROMPTS[:3]:
        req = CompletionRequest(kind=TEXT, model="tiny", prompt=prompt, max_tokens=24, block_size=4)
        job = Job(req, worker.prompt_ids(req))
        worker.submit(job)
        while (event := job.events.get(timeout=60))[0] == "delta":
            pass
        assert event[0] == "done"
        specs.append(event[3]["speculative_decoding"])
    worker.close()
    assert specs[0]["num_spec_steps"] == 1 + 3 and specs[0]["num_plain_steps"] > 0  # the window cut short: 3x slower
    assert [s["num_spec_steps"] for s in specs[1:]] == [0, 0] and all(s["num_plain_steps"] > 8 for s in specs[1:])
    assert len(worker.policies) == 1


def test_sampling_parameters_stop_and_seed(server):
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 16,
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "seed": 7,
        "block_size": 4,
        "min_confidence": 0.1,
        "lookup_fallback": 2,
    }
    a = _post(server.url, "/v1/completions", body)[1]
    b = _post(server.url, "/v1/completions", body)[1]
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # the seed makes it reproducible
    assert len(a["metrics"]["speculative_decoding"]["acceptance_histogram"]) == 4
    plain = _post(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16})[1]
    text = plain["choices"][0]["text"]
    word = text.split()[2]
    cut = _post(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16, "stop": [word]})[1]
    assert cut["choices"][0]["text"] == text[: text.index(word)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    auto = _post(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16, "block_size": "auto"})[1]
    assert auto["choices"][0]["text"] == text  # greedy: the same tokens, whatever widths auto chose
    tree = _post(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16, "tree_budget": 8})[1]
    assert tree["choices"][0]["text"] == text  # greedy: the same tokens through draft trees
    streamed = _stream(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16, "stop": word})
    assert _stream_text(streamed, chat=False) == text[: text.index(word)]


def test_stop_matcher_holds_back_a_possible_start():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == ("ab", False)
    assert m.feed("N") == ("c", False)
    assert m.feed("Dzz") == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("xyE") == ("x", False)
    assert m.feed("q") == ("y", False)
    assert m.flush() == "Eq"


BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "t1", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "t1", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "t1", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "t1", "tree_budget": -1}, 400, "tree_budget"),
    ("/v1/completions", {"prompt": "t1", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "t1", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "t1", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "t1", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "t1", "block_size": 99}, 400, "block_size"),
    ("/v1/completions", {"prompt": "t1", "block_size": "big"}, 400, "block_size"),
    ("/v1/completions", {"prompt": "t1", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "t1", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "t1", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "t1", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": [5] * 2048}, 400, "prompt"),  # longer than the context
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt"),  # a token id outside the vocabulary
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "off"},
        400,
        "chat_template_kwargs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        400,
        "chat_template_kwargs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"},
        400,
        "reasoning_effort",
    ),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/embeddings", {"input": "x"}, 404, None),
]


def test_every_bad_request_gets_a_4xx_with_an_openai_error_body(server, caplog):
    for path, body, status, param in BAD:
        got, err, _ = _post(server.url, path, body)
        assert got == status, (path, body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["message"] and err["error"]["param"] == param, (body, err)
    assert "context length" in _post(server.url, "/v1/completions", {"prompt": [5] * 2048})[1]["error"]["message"]
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) >= len(BAD)
    conn, resp = _request(server.url, "GET", "/health")
    assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
    status, ok, _ = _post(server.url, "/v1/completions", {"prompt": "t1", "max_tokens": 4})
    assert status == 200 and ok["usage"]["completion_tokens"] >= 1


def test_text_that_is_not_utf8_is_a_400_with_one_line(server):
    # A JSON escape of a lone surrogate decodes to a string no tokenizer can encode.
    for path, body, param in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "caf\ud800"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udce9"}]}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": "\ud800 t1"}, "prompt"),
    ]:
        status, err, _ = _post(server.url, path, body)
        assert status == 400 and err["error"]["param"] == param, err
        assert "is not valid UTF-8 text" in err["error"]["message"] and "\n" not in err["error"]["message"]
    # Bytes that are not UTF-8 at all.
    status, err, _ = _post(server.url, "/v1/completions", b'{"prompt": "caf\xe9"}')
    assert status == 400 and err["error"]["message"].startswith("The request body is not valid JSON")


def test_the_wrong_method_is_a_405_that_names_the_right_one(server):
    for method, path, allow in [("GET", "/v1/chat/completions", "POST"), ("GET", "/v1/completions", "POST"),
                                ("POST", "/v1/models", "GET"), ("POST", "/health", "GET")]:  # fmt: skip
        conn, resp = _request(server.url, method, path, {} if method == "POST" else None)
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == 405 and resp.getheader("Allow") == allow, (method, path)
        assert body["error"]["code"] == "method_not_allowed" and f"takes {allow}" in body["error"]["message"]
    conn, resp = _request(server.url, "GET", "/v1/nothing")
    assert resp.status == 404
    conn.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_sends_no_empty_chunks(server, path):
    # A stop string that never comes holds back the text's tail, so early cycles add no text.
    body = {"stop": ["#" * 30], "max_tokens": MAX_TOKENS, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "t1 t2 t3"}]} if "chat" in path else {"prompt": "t1 t2"})
    events = _stream(server.url, path, body)
    chunks = [c["choices"][0] for c in events if c["choices"]]
    chat = "chat" in path
    assert chunks[-1]["finish_reason"] and len(chunks) > 2
    for i, c in enumerate(chunks[:-1]):
        if chat:
            assert c["delta"].get("content") or c["delta"].get("reasoning_content") or (i == 0 and c["delta"]["role"])
        else:
            assert c["text"], chunks
    assert _stream_text(events, chat) == _stream_text(_stream(server.url, path, {**body, "stop": []}), chat)


def test_models_health_and_prometheus_metrics(server):
    conn, resp = _request(server.url, "GET", "/v1/models")
    models = json.loads(resp.read())
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["object"] == "model"
    assert models["data"][0]["dflash"]["block_size"] == 16
    _post(server.url, "/v1/completions", {"prompt": "t3", "max_tokens": 8})
    conn, resp = _request(server.url, "GET", "/metrics")
    text = resp.read().decode()
    assert resp.getheader("Content-Type").startswith("text/plain")
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    for name in (
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "plain_decode_num_steps_total",
        "generation_tokens_total",
    ):
        assert values["dflash:" + name] > 0 or name in (
            "spec_decode_num_accepted_tokens_total",
            "plain_decode_num_steps_total",
        )
        assert f"# TYPE dflash:{name} counter" in text
    assert "# TYPE dflash:generation_tokens_per_second gauge" in text


def test_eight_concurrent_streams_lose_duplicate_and_mix_nothing(server, qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    expected = [generate(model, draft, tokenizer, _chat_ids(tokenizer, p), max_tokens=MAX_TOKENS) for p in PROMPTS]
    results: dict[int, list] = {}

    def client(i):
        results[i] = _stream(
            server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[i]}]}
        )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    tic = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert time.monotonic() - tic < 60 and len(results) == len(PROMPTS)
    for i, events in results.items():
        assert len({e["id"] for e in events}) == 1  # one request's chunks only
        assert _stream_text(events) == expected[i]
        cycles = [e["dflash"] for e in events if "dflash" in e]
        assert [c["cycle"] for c in cycles] == list(range(len(cycles)))  # none lost or repeated
        assert sum(c["tokens"] for c in cycles) <= events[-1]["usage"]["completion_tokens"]


def _count_cycles_after_cancel(monkeypatch, srv) -> list[int]:
    """Per request, the cycles the worker asked ``stream_generate`` for once its job was cancelled."""
    from dflash_mlx import generation

    counts, inner = [], generation.stream_generate

    def counting(*args, **kwargs):
        job, responses = srv.worker.running, inner(*args, **kwargs)
        counts.append(0)
        try:
            while True:
                late = job.cancelled.is_set()
                try:
                    response = next(responses)
                except StopIteration:
                    return
                counts[-1] += late
                yield response
        finally:
            responses.close()

    monkeypatch.setattr(generation, "stream_generate", counting)
    return counts


def _until(condition, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_client_that_hangs_up_stops_its_generation(slow_pair, monkeypatch):
    srv = DFlashServer(*slow_pair, model_name="tiny", port=0).start()
    late_cycles = _count_cycles_after_cancel(monkeypatch, srv)
    try:
        conn, resp = _request(
            srv.url, "POST", "/v1/completions", {"prompt": "t1 t2", "max_tokens": 1500, "stream": True}
        )
        assert resp.status == 200
        resp.fp.readline()  # the first chunk
        resp.close()  # the client hangs up
        _until(lambda: srv.worker.completed == 1, "the first request to stop")
        values = srv.metrics.values
        assert values["request_cancelled_total"] == 1
        # The cycle in flight when the hang-up was noticed ends, and at most the one the worker had
        # already asked for when the cancel came: never 1500 tokens' worth.
        assert late_cycles[0] <= 1
        status, ok, _ = _post(srv.url, "/v1/completions", {"prompt": "t3", "max_tokens": 4})
        assert status == 200
        # A client waiting for a whole (non-streamed) answer that hangs up is noticed too.
        conn = http.client.HTTPConnection(*srv.httpd.server_address[:2], timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "t4", "max_tokens": 1500}))
        _until(lambda: srv.worker.running is not None, "the third request to start")
        conn.sock.close()
        _until(lambda: srv.worker.completed == 3, "the third request to stop")
        assert values["request_cancelled_total"] == 2
        assert late_cycles[1] == 0 and late_cycles[2] <= 1
    finally:
        srv.close()


def test_a_full_queue_answers_429_with_retry_after(slow_pair):
    srv = DFlashServer(*slow_pair, model_name="tiny", port=0, queue_size=1).start()
    try:
        _, running = _request(srv.url, "POST", "/v1/completions", {"prompt": "t1", "max_tokens": 1500, "stream": True})
        running.fp.readline()
        waiting = threading.Thread(target=_post, args=(srv.url, "/v1/completions", {"prompt": "t2", "max_tokens": 2}))
        waiting.start()
        deadline = time.monotonic() + 10
        while srv.worker.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, err, resp = _post(srv.url, "/v1/completions", {"prompt": "t3", "max_tokens": 2})
        assert status == 429 and err["error"]["code"] == "rate_limit_exceeded"
        assert int(resp.getheader("Retry-After")) >= 1
        running.close()
        waiting.join(20)
        assert not waiting.is_alive()
    finally:
        srv.close()


def test_close_cuts_the_running_stream_and_stops_listening(slow_pair):
    srv = DFlashServer(*slow_pair, model_name="tiny", port=0).start()
    conn, resp = _request(srv.url, "POST", "/v1/completions", {"prompt": "t1", "max_tokens": 1500, "stream": True})
    resp.fp.readline()
    # A kept-alive connection waiting for its next request does not hold the shutdown up.
    idle, health = _request(srv.url, "GET", "/health")
    assert health.read() == b'{"status": "ok"}' and not health.will_close
    tic = time.monotonic()
    srv.close()
    assert time.monotonic() - tic < 5
    events, done = _events(resp)
    assert events[-1]["error"]["code"] == "shutting_down" and done
    with pytest.raises(OSError):
        _request(srv.url, "GET", "/health", timeout=2)


def test_api_key(qwen3_pair):
    srv = DFlashServer(*qwen3_pair, model_name="tiny", port=0, api_key="sekret").start()
    try:
        body = {"prompt": "t1", "max_tokens": 2}
        status, err, _ = _post(srv.url, "/v1/completions", body)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        assert _post(srv.url, "/v1/completions", body, {"Authorization": "Bearer nope"})[0] == 401
        assert _post(srv.url, "/v1/completions", body, {"Authorization": "Bearer sekret"})[0] == 200
        assert _request(srv.url, "GET", "/health")[1].status == 200
    finally:
        srv.close()


def test_the_openai_client_works_unchanged(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "user", "content": PROMPTS[3]}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    spec = full.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] + spec["num_plain_steps"] >= 1
    text = client.completions.create(model="tiny", prompt="t4 t5", max_tokens=6)
    assert text.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages, temperature=-2)


def test_only_loopback_hosts_go_without_the_key_warning():
    from dflash_mlx.tools.server.app import _is_loopback

    assert all(_is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(_is_loopback(h) for h in ("0.0.0.0", "192.168.1.5", "::", "myhost"))


def test_cli_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--api-key" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--queue-size", "0"])
    assert e.value.code == 2 and "--queue-size must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        # What dflash-generate says of the same value, before anything loads (not a 400 on every request).
        (["--temp", "11"], "--temp must be from 0 to 10 (got 11)."),
        (["--top-p", "1.5"], "--top-p must be from 0 to 1 (got 1.5)."),
        (["--min-p", "-1"], "--min-p must be from 0 to 1 (got -1)."),
        (["--top-k", "-2"], "--top-k must be at least 0 (got -2)."),
        (["--max-tokens", "0"], "--max-tokens must be at least 1 (got 0)."),
        (["--port", "70000"], "--port must be from 0 to 65535 (got 70000)."),
        (["--max-context", "0"], "--max-context must be at least 1 (got 0)."),
        (["--prefill-step-size", "0"], "--prefill-step-size must be at least 1 (got 0)."),
        (["--min-confidence", "2"], "--min-confidence must be from 0 to 1 (got 2)."),
    ],
)
def test_out_of_range_defaults_are_refused_at_start(capsys, monkeypatch, argv, message):
    import dflash_mlx.loading.loading

    monkeypatch.setattr(dflash_mlx.loading.loading, "load", lambda *a, **k: pytest.fail("loaded before checking"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == f"dflash-serve: error: {message}"


def test_cli_serves_and_exits_cleanly_on_sigterm(pair_dirs, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_mlx.tools.server.app",
            "--model",
            str(pair_dirs["qwen3-tied"]),
            "--draft",
            str(pair_dirs["draft"]),
            "--port",
            "0",
            "--served-model-name",
            "tiny",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = _banner(proc.stderr, time.monotonic() + 60)
        assert "dflash-serve: tiny" in line and "http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split("/v1")[0]
        assert _post(url, "/v1/completions", {"prompt": "t1", "max_tokens": 3})[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()
        assert "stopping" in err and "running request is cut" not in err  # nothing was running
    finally:
        proc.kill()


def _line_before(stream, deadline: float) -> str:
    """The next line of a child's pipe, or "" once ``deadline`` passes or the pipe ends."""
    readable, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
    return stream.readline() if readable else ""


def _banner(stream, deadline: float) -> str:
    """The server's "serving at" line, past any log line before it (a note on the BLAS in use, say)."""
    for _ in range(20):
        line = _line_before(stream, deadline)
        if not line or "http://127.0.0.1:" in line:
            return line
    return line


def _bytes_until_closed(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            break
        if not piece:
            return data
        data += piece
    raise AssertionError(f"the server neither finished nor closed the connection; got {data!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sigterm_mid_request_still_gives_the_client_a_well_formed_answer(pair_dirs, stream):
    # The helper's handler threads write late once shutdown begins: the server must wait for them.
    helper = Path(__file__).parent / "helpers" / "slow_server.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(helper),
            "--model",
            str(pair_dirs["qwen3-tied"]),
            "--draft",
            str(pair_dirs["draft"]),
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            # The helper fakes the one-at-a-time worker's stream; the batching engine's shutdown is the same server's.
            "--max-batch",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    try:
        line = _banner(proc.stderr, deadline)
        assert "http://127.0.0.1:" in line, line
        host, port = line.split(" at http://")[1].split("/v1")[0].split(":")
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 10000, "stream": stream}).encode()
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert _line_before(proc.stdout, deadline).strip() == "generating"
        proc.send_signal(signal.SIGTERM)
        data = _bytes_until_closed(sock, deadline)
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        proc.kill()
        proc.wait()
    head, _, payload = data.partition(b"\r\n\r\n")
    status, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    if not stream:
        assert status.startswith("HTTP/1.1 503 "), data
        assert int(headers["content-length"]) == len(payload), data
        assert json.loads(payload)["error"]["code"] == "shutting_down"
    else:
        assert status.startswith("HTTP/1.1 200 ") and headers["content-type"] == "text/event-stream", data
        events = payload.decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], data[-300:]
        assert all(e.startswith("data: ") for e in events[:-2])
        chunks = [json.loads(e[6:]) for e in events[:-2]]
        assert chunks[0]["choices"][0]["text"] == " t1" and chunks[-1]["error"]["code"] == "shutting_down"


def test_a_conversation_continues_its_cache_and_stays_exact(server, qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    turn1 = [{"role": "user", "content": "t20 t21 t22"}]
    first = _post(server.url, "/v1/chat/completions", {"messages": turn1})[1]
    # Another conversation in between keeps its own cache.
    _post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "t90"}]})
    turn2 = turn1 + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "t23"},
    ]
    second = _post(server.url, "/v1/chat/completions", {"messages": turn2})[1]
    ids = list(tokenizer.apply_chat_template(turn2, add_generation_prompt=True))
    assert second["choices"][0]["message"]["content"] == generate(model, draft, tokenizer, ids, max_tokens=MAX_TOKENS)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


# A gpt-oss reply in harmony, as the scripted target writes it with the tiny tokenizer's words.
HARMONY_SCRIPT = ("<|channel|> analysis <|message|> t5 t6 <|end|> <|start|> assistant <|channel|> final <|message|> "
                  "t7 t8 t9 <|return|>")  # fmt: skip


def test_a_reasoning_models_reasoning_comes_back_as_reasoning_content(pair_dirs, tmp_path, monkeypatch):
    from helpers.chat_formats import script_target, token_ids, with_tokenizer, write_harmony_tokenizer

    from dflash_mlx import generation
    from dflash_mlx.tools.client import RemoteClient

    target = with_tokenizer(pair_dirs["qwen3-tied"], tmp_path / "target", write_harmony_tokenizer)
    model, draft, tokenizer = load(target, pair_dirs["draft"])
    script = token_ids(tokenizer, HARMONY_SCRIPT)
    script_target(monkeypatch, generation, script)  # what the session streams
    srv = DFlashServer(model, draft, tokenizer, model_name="gpt-oss", port=0).start()
    try:
        messages = [{"role": "user", "content": "t1 t2"}]
        status, full, _ = _post(srv.url, "/v1/chat/completions", {"messages": messages})
        assert status == 200
        assert full["choices"][0]["message"] == {"role": "assistant", "content": "t7t8t9", "reasoning_content": "t5t6"}
        events = _stream(srv.url, "/v1/chat/completions", {"messages": messages})
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert _stream_text(events) == "t7t8t9"
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "t5t6"
        # The reasoning streams first, and never as content.
        kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
        assert kinds == sorted(kinds, key=lambda k: k == "content") and "reasoning_content" in kinds
        # The next turn sends the answer back alone, as gpt-oss's template wants it.
        turns = [*messages, {"role": "assistant", "content": "t7t8t9"}, {"role": "user", "content": "t3"}]
        status, second, _ = _post(srv.url, "/v1/chat/completions", {"messages": turns})
        assert status == 200 and second["choices"][0]["message"]["reasoning_content"] == "t5t6"
        # dflash-chat --base-url gets the two apart too.
        responses = list(RemoteClient(srv.url + "/v1").stream_chat(messages, max_tokens=32))
        assert "".join(r.text for r in responses) == "t7t8t9" and "".join(r.reasoning for r in responses) == "t5t6"
        # A text completion is not a chat reply: its text comes as it is.
        status, text, _ = _post(srv.url, "/v1/completions", {"prompt": "t1 t2", "max_tokens": 32})
        assert text["choices"][0]["text"] == tokenizer.decode(script[:-1])
    finally:
        srv.close()


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(qwen3_pair, tmp_path):
    from helpers.chat_formats import write_gemma_tokenizer, write_harmony_tokenizer
    from mlx_lm.utils import load_tokenizer

    from dflash_mlx.tools.server.protocol import CHAT, parse_request
    from dflash_mlx.tools.server.worker import Worker

    model, draft, _ = qwen3_pair
    messages = [{"role": "system", "content": "t9"}, {"role": "user", "content": "t1"}]

    def prompts(write, server_args, *requests) -> list[str]:
        write(tmp_path / write.__name__)
        tokenizer = load_tokenizer(tmp_path / write.__name__, eos_token_ids=126)
        worker = Worker(model, draft, tokenizer, chat_template_args=server_args)
        try:
            return [tokenizer.decode(worker.prompt_ids(parse_request({"messages": messages, **r}, CHAT)))
                    for r in requests]  # fmt: skip
        finally:
            worker.close()

    # Gemma 4: the server thinks by default here; a request switches it off, keeping its system prompt.
    on, off = prompts(write_gemma_tokenizer, {"enable_thinking": True}, {},
                      {"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert on.startswith("<|turn>system<|think|>t9<turn|>") and off.startswith("<|turn>system" + "t9<turn|>")
    # gpt-oss: reasoning_effort, as OpenAI's API spells it, or through chat_template_kwargs.
    plain, high, low = prompts(write_harmony_tokenizer, None, {}, {"reasoning_effort": "high"},
                               {"chat_template_kwargs": {"reasoning_effort": "low"}})  # fmt: skip
    assert "Reasoning:" not in plain and "Reasoning:high" in high and "Reasoning:low" in low
    assert "<|start|>developer<|message|>t9<|end|>" in high


def test_a_successful_request_is_logged_and_the_banner_names_the_blas(server, caplog, qwen3_pair):
    import logging

    from dflash_mlx.cpu.openblas import blas_in_use
    from dflash_mlx.tools.server.app import banner

    with caplog.at_level(logging.INFO, logger="dflash-serve"):  # the default --log-level
        conn, resp = _request(server.url, "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert resp.status == 200
        resp.read()
        conn.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in lines), lines
    line = banner("tiny", qwen3_pair[1], "http://127.0.0.1:8000")
    assert line.startswith("dflash-serve: tiny (drafter block 16) at http://127.0.0.1:8000/v1")
    if sys.platform == "linux":
        assert line.endswith(f"; BLAS: {blas_in_use()}")


def test_a_frozen_datastore_keeps_no_reply(qwen3_pair, monkeypatch):
    """dflash-serve --frozen-datastore opens the datastore so that replies do not join it; without, they do."""
    from test_sampling import PROMPT

    from dflash_mlx.drafts.datastore import Datastore
    from dflash_mlx.tools.server import app
    from dflash_mlx.tools.session import Session

    model, draft, tokenizer = qwen3_pair
    for frozen in (True, False):
        store = Datastore(None, tokenizer.vocab_size, learns=not frozen)
        srv = app.DFlashServer(model, draft, tokenizer, model_name="tiny", port=0, max_batch=2, datastore=store)
        srv.start()
        try:
            assert _post(srv.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})[0] == 200
        finally:
            srv.close()
        assert len(store._replies) == (0 if frozen else 1)

    asked = []

    class Opened(Exception):
        pass

    def open_datastore(self, choice, **settings):
        asked.append(settings)
        raise Opened

    monkeypatch.setattr(Session, "open_datastore", open_datastore)
    for argv, learns in ((["--frozen-datastore"], False), ([], True)):
        with pytest.raises(Opened):
            app.main(["--model", "dflash-tiny", *argv])
        assert asked.pop() == {"learns": learns}
