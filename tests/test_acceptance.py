"""One definition of the mean acceptance length (tau), the same number on every surface.

tau = tokens emitted by drafting cycles / drafting cycles; plain cycles (no draft) are counted
apart. One scripted run that mixes both kinds of cycle is read back from the API, the
``dflash-generate --verbose`` stats line, the server's per-request metrics and counters, the
chat panel, its reply line and ``/save`` footer, and the benchmark's table: they all agree, and
the tokens add up (1 + tau x drafting cycles + plain cycles).
"""

import re
from functools import partialmethod

import pytest
from helpers.checkpoints import VOCAB
from helpers.oracles import ScriptedDraft
from helpers.policy import Clock
from test_generate import reference
from test_tui import SIZE, finish, ready, send

from dflash_mlx import generate, stream_generate
from dflash_mlx.text.chat_template import render_chat
from dflash_mlx.text.responses import AcceptanceStats
from dflash_mlx.tuning.policy import PolicyState

MESSAGE = "t2 t4 t6"
MAX_TOKENS, BLOCK = 40, 4


def test_tau_counts_drafting_cycles_only():
    stats = AcceptanceStats()
    for num_draft, tokens in [(3, 4), (0, 1), (3, 1), (0, 1), (0, 1), (3, 2), (2, 3)]:
        stats.add(num_draft, tokens)
    assert (stats.drafting_cycles, stats.drafting_tokens, stats.plain_cycles) == (4, 10, 3)
    assert stats.tau == pytest.approx(2.5)  # 10 / 4; over all 7 cycles it would read 13 / 7 = 1.86
    assert stats.tokens == 13 and stats.cycles == 7 and stats.accepted_drafts == 6 and stats.draft_tokens == 11
    assert stats.lengths == {1: 1, 2: 1, 3: 1, 4: 1}
    assert stats.by_draft_length == {2: [0, 0, 1], 3: [1, 1, 0, 1]}
    assert stats.describe() == "tau 2.50 over 4 drafting cycles; 3 plain"
    assert AcceptanceStats().describe() == "no drafting cycles; 0 plain" and AcceptanceStats().tau == 1.0
    merged = AcceptanceStats.from_totals(stats.tau, stats.drafting_cycles, stats.plain_cycles)
    merged.merge(stats)
    assert (merged.tau, merged.drafting_cycles, merged.plain_cycles) == (2.5, 8, 6)


@pytest.fixture
def scripted(qwen3_pair, monkeypatch):
    """Every policy reads a clock that ticks 1 s a reading and refreshes its plain time every
    4 drafting cycles, so each run mixes drafting and plain cycles the same way; the drafter
    proposes the target's own continuation, wrong at every third position."""
    model, draft, tokenizer = qwen3_pair
    monkeypatch.setattr(PolicyState, "__init__", partialmethod(PolicyState.__init__, clock=Clock(step=1.0), refresh=4))
    ids = render_chat(tokenizer, [{"role": "user", "content": MESSAGE}])
    sequence = list(ids) + reference(model, list(ids), MAX_TOKENS + BLOCK)
    return model, draft, lambda base: ScriptedDraft(base, sequence, VOCAB, wrong_every=3), tokenizer, list(ids)


def _numbers(text: str) -> tuple[float, int, int]:
    m = re.search(r"tau (\d+\.\d\d) over (\d+) drafting cycles?; (\d+) plain", text)
    assert m, text
    return float(m[1]), int(m[2]), int(m[3])


async def test_every_surface_shows_the_same_tau(scripted, pair_dirs, capsys, tmp_path):
    model, base, oracle, tokenizer, ids = scripted
    draft = oracle(base)
    settings = dict(block_size=BLOCK, max_tokens=MAX_TOKENS)

    # The API.
    responses = list(stream_generate(model, draft, tokenizer, ids, policy=PolicyState(), **settings))
    last = responses[-1]
    tau, drafting, plain = last.mean_acceptance_length, last.drafting_cycles, last.plain_cycles
    # (The policy's probe cycles verify a looked-up draft where one is found: drafting cycles too.)
    assert drafting > 0 and tau > 1.0
    assert last.generation_tokens == 1 + round(tau * drafting) + plain  # the tokens add up
    assert drafting + plain == last.cycle
    expected = (round(tau, 2), drafting, plain)

    # dflash-generate --verbose.
    generate(model, draft, tokenizer, ids, verbose=True, policy=PolicyState(), **settings)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Acceptance length:"))
    assert _numbers(line) == expected

    # The server: per-request metrics and the Prometheus counters.
    from dflash_mlx.tools.server.protocol import TEXT, CompletionRequest
    from dflash_mlx.tools.server.worker import Job, Worker

    worker = Worker(model, draft, tokenizer)
    req = CompletionRequest(kind=TEXT, model="tiny", prompt=ids, max_tokens=MAX_TOKENS, block_size=BLOCK)
    job = Job(req, worker.prompt_ids(req))
    worker.submit(job)
    while (event := job.events.get(timeout=60))[0] == "delta":
        pass
    worker.close()
    spec = event[3]["speculative_decoding"]
    assert (round(spec["mean_acceptance_length"], 2), spec["num_spec_steps"], spec["num_plain_steps"]) == expected
    counters = worker.metrics.values
    assert 1 + counters["spec_decode_num_accepted_tokens_total"] / counters["spec_decode_num_drafts_total"] == (
        pytest.approx(tau)
    )
    assert counters["plain_decode_num_steps_total"] == plain

    # The benchmark: its own counting of a drained stream, its row and its table.
    from dflash_mlx.tools.bench.report import markdown
    from dflash_mlx.tools.bench.stats import summarize
    from dflash_mlx.tools.bench.timing import RunResult, time_stream

    out, gen_s, _, accept, sizes, _ = time_stream(
        stream_generate(model, draft, tokenizer, ids, policy=PolicyState(), **settings), lambda r: r.tokens
    )
    row = summarize([RunResult("dflash", BLOCK, 0, "chat", len(out), 10.0, 10.0, accept, verify_sizes=sizes)], {})[0]
    assert (round(row["tau"], 2), row["drafting_cycles"], row["plain_cycles"]) == expected
    meta = {"machine": "m", "device": "d", "blas": "b", "mlx": "1", "mlx_lm": "1", "commit": "c", "date": "now"}
    assert f"| {tau:.2f} | {drafting} / {plain} |" in markdown([row], meta, {})

    # The chat: the panel (the reply and the conversation), the reply's line and the /save footer.
    from dflash_mlx.tui.app import ChatApp
    from dflash_mlx.tui.commands import Settings
    from dflash_mlx.tui.engine import MLXEngine

    engine = MLXEngine(str(pair_dirs["qwen3-tied"]), str(pair_dirs["draft"]))
    app = ChatApp(engine, settings=Settings(max_tokens=MAX_TOKENS, block_size=BLOCK))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        engine._run(lambda: setattr(engine, "draft", oracle(engine.draft)))
        await send(pilot, MESSAGE)
        await finish(pilot)
        live = str(app.query_one("#live").render())
        caption = str(app.query_one("#caption").render())
        for text in (live, caption):
            assert f"{tau:>6.2f}" in text and f"draft cycles{drafting:>6}" in text and f"plain cycles{plain:>6}" in text
        assert _numbers(app.turns[1]["stats"]) == expected
        await send(pilot, f"/save {tmp_path / 'chat.md'}")
        await finish(pilot)
    footer = (tmp_path / "chat.md").read_text().strip().splitlines()[-1]
    assert _numbers(footer) == expected
