"""The OpenAI-compatible client (dflash-chat --base-url, dflash-bench --base-url) against our
server and against a fake one answering with vLLM's and SGLang's documented shapes."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_mlx import DFlashError, generate, stream_generate
from dflash_mlx.tools.client import RemoteClient, parse_prometheus
from dflash_mlx.tools.server.app import DFlashServer
from dflash_mlx.tools.server.protocol import Defaults

WORDS = ["Hello", ",", " wor", "ld", "!"]


@pytest.fixture(scope="module")
def server(qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    srv = DFlashServer(model, draft, tokenizer, model_name="tiny", port=0, defaults=Defaults(max_tokens=20)).start()
    yield srv
    srv.close()


def test_our_server_streams_the_same_text_and_per_cycle_statistics(server, qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    client = RemoteClient(server.url + "/v1")
    info = client.server_info()
    assert (info.kind, info.model, info.block_size) == ("dflash", "tiny", 16)
    messages = [{"role": "user", "content": "t3 t4 t5"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # A seed turns the adaptive policy off on both sides, so both draft in the same cycles.
    expected = list(stream_generate(model, draft, tokenizer, ids, max_tokens=20, seed=0))
    responses = list(client.stream_chat(messages, max_tokens=20, temperature=0, seed=0))
    assert "".join(r.text for r in responses) == generate(model, draft, tokenizer, ids, max_tokens=20)
    cycles = [r for r in responses if r.cycle > 0]
    assert [r.acceptance_length for r in cycles] == [r.acceptance_length for r in expected if r.cycle > 0]
    assert cycles[-1].mean_acceptance_length == pytest.approx(expected[-1].mean_acceptance_length)
    last = responses[-1]
    assert last.finish_reason == expected[-1].finish_reason and last.cycle == 0
    assert (last.mean_acceptance_length, last.drafting_cycles, last.plain_cycles) == pytest.approx(
        (expected[-1].mean_acceptance_length, expected[-1].drafting_cycles, expected[-1].plain_cycles)
    )
    assert last.generation_tokens == expected[-1].generation_tokens


def test_client_errors_are_one_clear_line(server, qwen3_pair):
    with pytest.raises(DFlashError, match="has no model 'gpt-4'; it has: tiny"):
        RemoteClient(server.url + "/v1", model="gpt-4").server_info()
    with pytest.raises(DFlashError, match="Cannot reach the server"):
        RemoteClient("http://127.0.0.1:9/v1", timeout=2).server_info()
    keyed = DFlashServer(*qwen3_pair, model_name="k", port=0, api_key="right").start()
    try:
        with pytest.raises(DFlashError, match="refused the API key"):
            RemoteClient(keyed.url + "/v1", api_key="wrong").server_info()
        client = RemoteClient(keyed.url + "/v1", api_key="right")
        assert "".join(r.text for r in client.stream_completion("t1", max_tokens=3))
    finally:
        keyed.close()


# ---- a fake vLLM / SGLang / plain server --------------------------------------------------------


class Fake:
    """What the fake server answers: its kind, counters, and the requests it saw."""

    def __init__(self, kind: str, api_key: str | None = None):
        self.kind, self.api_key, self.requests = kind, api_key, []
        self.drafts = self.accepted = 0.0


def _fake_handler(fake: Fake):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self):
            if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                self._json(
                    401,
                    {
                        "error": {
                            "message": "Unauthorized",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": None,
                        }
                    },
                )
                return False
            return True

        def do_GET(self):
            if self.path == "/v1/models":
                if self._authorised():
                    owner = {"vllm": "vllm", "vllm-counters": "vllm", "sglang": "sglang", "sglang-meta": "sglang"}.get(
                        fake.kind, "system"
                    )
                    self._json(
                        200, {"object": "list", "data": [{"id": "Qwen/Qwen3-8B", "object": "model", "owned_by": owner}]}
                    )
            elif self.path == "/metrics" and fake.kind.startswith("vllm"):
                label = '{engine="0",model_name="Qwen/Qwen3-8B"}'
                text = (
                    f"# TYPE vllm:spec_decode_num_drafts_total counter\n"
                    f"vllm:spec_decode_num_drafts_total{label} {fake.drafts}\n"
                    f"# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
                    f"vllm:spec_decode_num_accepted_tokens_total{label} {fake.accepted}\n"
                    f"vllm:generation_tokens_total{label} 100.0\n"
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            elif self.path == "/metrics" and fake.kind == "sglang":
                text = (
                    b'sglang:spec_accept_length{dp_rank="0",engine_type="unified",model_name="Qwen/Qwen3-8B",'
                    b'tp_rank="0"} 2.5\nsglang:num_running_reqs{model_name="Qwen/Qwen3-8B"} 0.0\n'
                )
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.requests.append(body)
            if not self._authorised():
                return
            # The engine drafts: 4 verification steps, 9 accepted tokens (tau 3.25).
            fake.drafts += 4
            fake.accepted += 9
            usage = {"prompt_tokens": 7, "completion_tokens": len(WORDS), "total_tokens": 7 + len(WORDS)}
            if fake.kind == "sglang-meta":
                # SGLang's non-streaming answer with return_meta_info: meta_info on the choice.
                meta = {"spec_accept_length": 2.75, "spec_verify_ct": 4, "completion_tokens": len(WORDS)}
                return self._json(
                    200,
                    {
                        "id": "1",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "meta_info": meta,
                                "message": {"role": "assistant", "content": "".join(WORDS)},
                            }
                        ],
                        "usage": usage,
                    },
                )
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def send(obj):
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

            base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": body["model"]}
            for i, word in enumerate(WORDS):
                delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
                send({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            send({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            final = {**base, "choices": [], "usage": usage}
            if fake.kind == "vllm":  # started with --per-request-spec-decode-metrics summary
                final["metrics"] = {
                    "speculative_decoding": {
                        "mean_acceptance_length": 3.25,
                        "draft_acceptance_rate": 0.15,
                        "acceptance_histogram": [1, 0, 1, 2] + [0] * 12,
                        "acceptance_histogram_by_draft_length": {"15": [1, 0, 1, 2] + [0] * 12},
                        "num_spec_steps": 4,
                        "num_accepted_draft_tokens": 9,
                        "num_draft_tokens": 60,
                        "num_spec_tokens": 15,
                    }
                }
            send(final)
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


@pytest.fixture
def fake_server():
    servers = []

    def start(kind: str, api_key: str | None = None):
        fake = Fake(kind, api_key)
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _fake_handler(fake))
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(httpd)
        return fake, f"http://127.0.0.1:{httpd.server_address[1]}/v1"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    "kind, tau, steps, source",
    [
        ("vllm", 3.25, 4, "per-request metrics"),
        ("vllm-counters", 1 + 9 / 4, 4, "vllm:spec_decode"),
        ("sglang", 2.5, 1, "gauge"),
        ("sglang-meta", 2.75, 4, "meta_info"),
    ],
)
def test_tau_from_vllm_and_sglang_shapes(fake_server, kind, tau, steps, source):
    fake, url = fake_server(kind)
    client = RemoteClient(url)
    info = client.server_info()
    assert info.model == "Qwen/Qwen3-8B" and source in info.tau_source
    responses = list(client.stream_chat([{"role": "user", "content": "hi"}], max_tokens=8))
    assert "".join(r.text for r in responses) == "".join(WORDS)
    last = responses[-1]
    assert last.finish_reason == "stop" and last.mean_acceptance_length == pytest.approx(tau)
    assert last.cycle == steps and last.generation_tokens == len(WORDS)
    assert responses[-2].cycle == 0 and responses[-2].prompt_tokens == 7
    # Our own fields only go to our server; SGLang is asked for meta_info.
    sent = fake.requests[-1]
    assert "block_size" not in sent and sent["stream"] is True
    assert sent.get("return_meta_info") is (True if kind.startswith("sglang") else None)


def test_a_server_without_statistics_says_why_tau_is_na(fake_server):
    fake, url = fake_server("plain")
    client = RemoteClient(url)
    info = client.server_info()
    assert info.kind == "openai" and info.tau_source is None
    assert "tau n/a: this server reports no speculative-decoding statistics" in info.describe()
    responses = list(client.stream_chat([{"role": "user", "content": "hi"}]))
    assert responses[-1].finish_reason == "stop" and responses[-1].cycle == 0


def test_wrong_key_is_a_clear_error(fake_server):
    fake, url = fake_server("vllm", api_key="k1")
    with pytest.raises(DFlashError, match="refused the API key.*--api-key"):
        RemoteClient(url, api_key="wrong").server_info()
    assert RemoteClient(url, api_key="k1").server_info().kind == "vllm"


def test_parse_prometheus_sums_label_sets():
    text = '# HELP x y\nvllm:a_total{engine="0"} 2.0\nvllm:a_total{engine="1"} 3\nplain 1e3\n'
    assert parse_prometheus(text) == {"vllm:a_total": 5.0, "plain": 1000.0}


# ---- dflash-chat --base-url ---------------------------------------------------------------------


async def test_chat_app_against_our_server(server):
    from test_tui import SIZE, finish, ready, send

    from dflash_mlx.tui.app import make_app
    from dflash_mlx.tui.widgets import Reply

    app = make_app("tiny", base_url=server.url + "/v1", max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert "tiny @ " in app.info.name and "tau from" in app.info.name
        await send(pilot, "t1 t2")
        await finish(pilot)
        reply = app.query_one(Reply)
        stats = str(reply.query_one(".reply-stats").render())
        assert reply.body.source and "drafting cycle" in stats
        assert app.turns[-1]["role"] == "assistant"


async def test_chat_app_keeps_the_text_when_the_server_fails(fake_server):
    from test_tui import SIZE, finish, ready, send

    from dflash_mlx.tui.app import make_app
    from dflash_mlx.tui.widgets import PromptInput

    fake, url = fake_server("vllm", api_key="k1")
    app = make_app(None, base_url=url, api_key="k1")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        fake.api_key = "rotated"  # the next request is refused
        await send(pilot, "keep me")
        await finish(pilot)
        assert app.query_one(PromptInput).text == "keep me"
        assert app.turns == []


# ---- dflash-bench --base-url ---------------------------------------------------------------------


def test_bench_base_url_measures_each_concurrency_level(qwen3_pair, tmp_path, capsys, monkeypatch):
    from functools import partialmethod

    from helpers.policy import Clock

    from dflash_mlx.tools.bench.benchmark import main
    from dflash_mlx.tuning.policy import PolicyState

    # The server's policy on a clock where drafting never loses, so every request drafts and
    # tau comes back both ways (what it learns lasts across requests: on real time, a drafter
    # that loses would leave every later request plain, and tau n/a).
    monkeypatch.setattr(PolicyState, "__init__", partialmethod(PolicyState.__init__, clock=Clock(step=1.0)))
    server = DFlashServer(*qwen3_pair, model_name="tiny", port=0, defaults=Defaults(max_tokens=20)).start()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"t{i} t{i + 1}"}) for i in range(1, 5)) + "\n")
    out = tmp_path / "load.json"
    try:
        main(
            [
                "--base-url",
                server.url + "/v1",
                "--prompts",
                str(prompts),
                "--concurrency",
                "1",
                "3",
                "--max-tokens",
                "8",
                "--json",
                str(out),
            ]
        )
    finally:
        server.close()
    table = capsys.readouterr().out
    assert "| clients | requests |" in table and "requests/min" in table
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for level in result["levels"]:
        assert level["requests"] == 4 and not level["errors"]
        assert 4 <= level["tokens"] <= 4 * 8 and level["tok_s"] > 0 and level["requests_per_min"] > 0
        assert level["tau"] >= 1 and level["tau_counters"] == pytest.approx(level["tau"])  # one definition
        assert level["drafting_cycles"] > 0
    # Three at once, batched, each reply is the one the prompt got alone (greedy).
    alone, together = (level["texts"] for level in result["levels"])
    assert None not in alone and together == alone


def test_bench_base_url_unreachable_is_one_line(capsys):
    from dflash_mlx.tools.bench.benchmark import main

    with pytest.raises(SystemExit) as e:
        main(["--base-url", "http://127.0.0.1:9/v1", "--concurrency", "1"])
    assert e.value.code == 1
    assert capsys.readouterr().err.startswith("dflash-bench: error: Cannot reach the server")
