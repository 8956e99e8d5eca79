"""DFlash on a target sharded over 2 and 3 ranks: mlx.distributed's ring on 127.0.0.1, each rank a
process (helpers/ranks.py), tiny fp32 targets built alike on every rank (helpers/sharded.py).

On every rank, DFlash on the sharded target gives the unsharded target's plain greedy tokens
(tensor parallel on 2 and 3 ranks, including Qwen3.5's vocabulary-sharded head, and pipeline
parallel: mlx-lm's for a hybrid and an MLA family, ours for Qwen3, Llama and gpt-oss with sliding
window layers and Gemma 4), and seeded sampling gives unsharded DFlash's tokens; a draft tree's
target pass on our split gives one process's. A rank that leaves, mid-generation or during the load,
ends the job with one line that names it.
"""

import json
import re
import shutil
import signal
import time
import urllib.request

import mlx.core as mx
import pytest
from helpers.ranks import finish, launch, python, start, stop
from helpers.sharded import split_weights, write_pair

SHARDED = "tests/helpers/sharded.py"
FAKE_HUB = "tests/helpers/fake_hub.py"
TIMEOUT = 240  # seconds for a whole launch, on two busy cores


def _check(ranks, cases: list[str]) -> None:
    for r in ranks:
        assert r.returncode == 0, r.describe()
    runs = [{x["case"]: x for x in r.results() if "tokens" in x} for r in ranks]
    for r, mine in zip(ranks, runs):
        assert set(cases) <= set(mine), r.describe()
        for case in cases:
            # One process's tokens, run by rank 0 (a run on every rank would only cost time).
            expected = runs[0][case]["reference"]
            assert expected and mine[case]["tokens"] == expected, f"{case} on rank {r.rank}"


# ":oracle": rank 0 drafts the target's own text, so every rank must verify exactly rank 0's drafts (a random
# drafter's are rejected at once, whatever the other ranks verified).
# The families mlx-lm does not pipeline (our own split of their layers), greedy and seeded; on 2 ranks Gemma 4's
# last layer reuses layer 1's keys and values (rank 0 then runs layers 1..3).
OWN_PIPELINES = ["qwen3", "llama", "gpt_oss", "gemma4"]
GREEDY_ON_TWO = ["qwen3:tensor", "qwen3_5:tensor", "qwen3_5:pipeline", "kimi_k25:tensor", "kimi_k25:pipeline",
                 "qwen3:tensor:oracle", "qwen3_5:pipeline:oracle", "qwen3:pipeline", "llama:pipeline",
                 "gpt_oss:pipeline", "gemma4_kv:pipeline", "gpt_oss:pipeline:oracle"]  # fmt: skip
SAMPLED_ON_TWO = ["qwen3_5:pipeline:7"] + [f"{kind}:pipeline:7" for kind in OWN_PIPELINES]
# A draft tree's pass on our split (the loop itself refuses trees on a sharded target for now).
TREES_ON_TWO = ["qwen3:tree", "gemma4_kv:tree"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    # One launch for every 2-rank case: most of a launch is starting Python and MLX on each rank.
    cases = [*GREEDY_ON_TWO, *SAMPLED_ON_TWO, *TREES_ON_TWO]
    return launch(2, python(SHARDED, *cases), tmp_path_factory.mktemp("two"), TIMEOUT)


def test_greedy_on_two_ranks_equals_plain_greedy(two_ranks):
    _check(two_ranks, GREEDY_ON_TWO)


def test_greedy_and_seeded_on_three_ranks_equal_one_process(tmp_path):
    # Rank 2 holds one linear attention layer alone; rank 1 a dense layer of the MoE model; of our own
    # splits, rank 2 a sliding window layer alone and rank 1 a full attention layer alone.
    cases = ["qwen3_6h:tensor", "qwen3_5:pipeline", "kimi_k25:pipeline"]
    cases += [f"{kind}:pipeline" for kind in OWN_PIPELINES] + [f"{kind}:pipeline:3" for kind in OWN_PIPELINES]
    cases += ["llama:tree", "gpt_oss:tree", "gemma4:tree"]  # a draft tree's pass on our split
    _check(launch(3, python(SHARDED, *cases), tmp_path, TIMEOUT), cases)


def test_seeded_sampling_equals_unsharded_dflash(two_ranks):
    _check(two_ranks, SAMPLED_ON_TWO)


def test_a_draft_trees_pass_on_our_pipeline_equals_one_process(two_ranks):
    _check(two_ranks, TREES_ON_TWO)


@pytest.mark.parametrize(
    "n, kind, flag, layers",
    [(2, "qwen3_moe", "--pipeline", [[2, 3], [0, 1]]), (3, "qwen3_moe", "--pipeline", [[2, 3], [1], [0]]),
     (3, "qwen3_6h", "--tensor-parallel", [[0, 1, 2, 3]] * 3)],
)  # fmt: skip
def test_dflash_generate_on_several_ranks_prints_the_single_process_text(n, kind, flag, layers, tmp_path, capsys):
    # From a (fake) hub, each rank downloads of the target's weights only the files that hold its
    # layers (one file a layer here) and the file of no layer; the drafter whole.
    from dflash_mlx.tools.cli.generate import main

    target, draft = write_pair(tmp_path / "pair", kind)
    files = split_weights(target)
    hub = tmp_path / "hub"
    shutil.copytree(target, hub / "someone--tiny")
    shutil.copytree(draft, hub / "someone--tiny-draft")
    argv = [
        "--temp",
        "0",
        "--prompt",
        "t5 t17 t42 t9",
        "--max-tokens",
        "24",
        "--ignore-chat-template",
        "--verbose",
        "F",
    ]
    main(["--model", str(target), "--draft", str(draft), *argv])
    alone = capsys.readouterr().out
    assert len(alone.split()) == 24
    argv = ["--model", "someone/tiny", "--draft", "someone/tiny-draft", *argv, flag]
    ranks = launch(n, python(FAKE_HUB, str(hub), str(tmp_path), "--", *argv), tmp_path, TIMEOUT)
    assert [r.returncode for r in ranks] == [0] * n, "\n".join(r.describe() for r in ranks)
    assert ranks[0].stdout == alone
    assert [r.stdout for r in ranks[1:]] == [""] * (n - 1)  # rank 0 prints
    for r, kept in zip(ranks, layers):
        lines = (tmp_path / f"rank{r.rank}-downloads.jsonl").read_text().splitlines()
        downloads = {}
        for x in map(json.loads, lines):
            downloads.setdefault(x["repo"], set()).update(x["files"])
        weights = {f for f in downloads["someone/tiny"] if f.endswith(".safetensors")}
        assert weights == {files[0], *(files[1 + i] for i in kept)}, f"rank {r.rank}"
        assert "model.safetensors" in downloads["someone/tiny-draft"]


def test_dflash_generate_runs_the_toy_pair_on_two_ranks_as_one_process(tmp_path, capsys):
    # The toy pair's Qwen3 target: tensor parallel by mlx-lm, and as a pipeline of our own split of its layers.
    from dflash_mlx.tools.cli.generate import main

    argv = ["--model", "dflash-tiny", "--temp", "0", "--prompt", "Once upon a time", "--max-tokens", "32",
            "--verbose", "F"]  # fmt: skip
    main(argv)
    alone = capsys.readouterr().out
    assert len(alone) > 40
    for flag in ("--pipeline", "--tensor-parallel"):
        # HOME: what the ranks measure and keep is kept in the test's folder, not the user's.
        ranks = launch(2, python("-m", "dflash_mlx.tools.cli.generate", *argv, flag), tmp_path, TIMEOUT,
                       env={"HOME": str(tmp_path)})  # fmt: skip
        assert [r.returncode for r in ranks] == [0, 0], "\n".join(r.describe() for r in ranks)
        assert (ranks[0].stdout, ranks[1].stdout) == (alone, ""), flag


def _complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.loads(response.read())


def test_dflash_serve_on_two_ranks_answers_as_one_process_does(tmp_path):
    from dflash_mlx import load
    from dflash_mlx.tools.server.app import DFlashServer

    target, draft = write_pair(tmp_path / "pair", "qwen3_moe")
    requests = [
        {"prompt": "t5 t17 t42 t9", "max_tokens": 16, "temperature": 0},
        {"prompt": "t5 t17 t42 t9", "max_tokens": 16, "temperature": 0, "stop": ["t60"]},  # cut mid-generation
        {"prompt": "t8 t3", "max_tokens": 12, "temperature": 1.0, "seed": 3},
    ]
    alone = DFlashServer(*load(target, draft), port=0).start()
    try:
        expected = [_complete(alone.url, r)["choices"][0]["text"] for r in requests]
    finally:
        alone.close()
    procs = start(2, python("-m", "dflash_mlx.tools.server.app", "--model", str(target), "--draft", str(draft), "--port", "0",
                            "--tensor-parallel"), tmp_path)  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while "http://127.0.0.1:" not in (err := (tmp_path / "rank0.err").read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, err
            time.sleep(0.2)
        url = re.search(r"http://127\.0\.0\.1:\d+", err).group(0)
        assert [_complete(url, r)["choices"][0]["text"] for r in requests] == expected
        procs[0].send_signal(signal.SIGTERM)
        ranks = finish(procs, tmp_path, timeout=30)
    finally:
        stop(procs)
    assert [r.returncode for r in ranks] == [0, 0], "\n".join(r.describe() for r in ranks)


def test_an_idle_dflash_serve_exits_when_a_rank_dies(tmp_path):
    target, draft = write_pair(tmp_path / "pair", "qwen3")
    procs = start(2, python("-m", "dflash_mlx.tools.server.app", "--model", str(target), "--draft", str(draft), "--port", "0",
                            "--pipeline"), tmp_path, env={"HOME": str(tmp_path)})  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while "http://127.0.0.1:" not in (err := (tmp_path / "rank0.err").read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, err
            time.sleep(0.2)
        # After a request, idle: the watch kept from the load finds it at once (the heartbeat within seconds).
        url = re.search(r"http://127\.0\.0\.1:\d+", err).group(0)
        _complete(url, {"prompt": "t5 t17", "max_tokens": 4, "temperature": 0})
        procs[1].kill()
        ranks = finish(procs, tmp_path, timeout=30)
    finally:
        stop(procs)
    assert _gone(ranks[0]), ranks[0].describe()


def _gone(rank) -> bool:
    # Exited by itself (not ended by us) with the one line that names the rank that went away (last: MLX's
    # ring may print lines of its own before it; a server's log line starts with the time).
    last = (rank.stderr.strip().splitlines() or [""])[-1]
    return rank.returncode > 0 and last.endswith(
        "Rank 1 of this sharded job went away (its connection was lost): exiting."
    )


def test_a_killed_rank_ends_the_job(tmp_path):
    # Rank 1 of 3, mid-generation: rank 0 finds it, and tells rank 2, which holds a connection to rank 0 only.
    procs = start(3, python(SHARDED, "qwen3:pipeline", "--max-tokens", "1000000", "--no-reference"), tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while "started" not in (tmp_path / "rank0.out").read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "rank0.err").read_text()
            time.sleep(0.2)
        procs[1].kill()
        ranks = finish(procs, tmp_path, timeout=30)
    finally:
        stop(procs)
    assert _gone(ranks[0]) and _gone(ranks[2]), "\n".join(r.describe() for r in ranks)


def test_a_rank_that_fails_its_sharded_load_ends_the_job(tmp_path):
    # Rank 1 lacks the file of its layer 0 and stops; rank 0, which has its own layers, would wait for it for
    # good in the load's last collective.
    target, draft = write_pair(tmp_path / "pair", "qwen3")
    files = split_weights(target)
    (target / files[1]).unlink()
    argv = ["--model", str(target), "--draft", str(draft), "--prompt", "t5 t17", "--max-tokens", "4", "--pipeline"]
    ranks = launch(
        2, python("-m", "dflash_mlx.tools.cli.generate", *argv), tmp_path, TIMEOUT, env={"HOME": str(tmp_path)}
    )
    assert ranks[1].returncode > 0 and files[1] in ranks[1].stderr, ranks[1].describe()
    assert _gone(ranks[0]), ranks[0].describe()


@pytest.mark.parametrize(
    "flags, message",
    [(["--pipeline"], "this process is alone"), (["--pipeline-split", "3,1"], "--pipeline-split needs --pipeline"),
     (["--tensor-parallel", "--pipeline"], "not allowed with")],
)  # fmt: skip
def test_parallel_flags_need_mlx_launch(flags, message, capsys):
    from dflash_mlx.tools.cli.generate import main

    with pytest.raises(SystemExit):
        main(["--model", "nowhere", *flags])
    assert message in capsys.readouterr().err


def test_a_pipeline_rank_reads_the_files_of_its_layers_and_of_no_layer():
    from dflash_mlx.loading.sharding import layer_files

    weight_map = {"model.embed_tokens.weight": "a", "model.layers.0.mlp.w": "b", "model.layers.1.mlp.w": "c",
                  "model.layers.10.mlp.w": "d", "language_model.model.layers.1.norm.w": "e", "lm_head.weight": "f"}  # fmt: skip
    assert layer_files(weight_map, range(1, 2)) == {"a", "c", "e", "f"}
    assert layer_files(weight_map, None) == set(weight_map.values())


def test_a_sharded_target_refuses_block_size_auto():
    from dflash_mlx.base.errors import DFlashError
    from dflash_mlx.loop.distributed import check_sharded

    with pytest.raises(DFlashError, match="pass a fixed block size"):
        check_sharded(None, None, choose_width=True)


class _Group:
    # A rank of a world, for the layout alone (nothing is sent).
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("size, split", [(2, None), (3, None), (3, [1, 2, 3])])
def test_our_split_keeps_the_layers_mlx_lm_pipeline_keeps(size, split):
    # The same run of layers on each rank as mlx-lm's PipelineMixin (qwen2 has one), the same global indices.
    from helpers.sharded import COMMON
    from mlx_lm.models import qwen2, qwen3

    from dflash_mlx.models.stages import Stage, split_decoder

    layers = {**COMMON, "num_hidden_layers": 6, "tie_word_embeddings": True}
    for rank in range(size):
        theirs = qwen2.Model(qwen2.ModelArgs.from_dict({**layers, "model_type": "qwen2"})).model
        theirs.pipeline(_Group(rank, size), split=split)
        ours = qwen3.Model(qwen3.ModelArgs.from_dict({**layers, "model_type": "qwen3"})).model
        kept = ours.layers[:]
        split_decoder(ours, _Group(rank, size), split)
        assert [x is None for x in ours.layers] == [x is None for x in theirs.layers]
        assert (ours.start_idx, ours.end_idx) == (theirs.start_idx, theirs.end_idx)
        assert [(i, id(x)) for i, x in Stage(ours, 6).layers] == [
            (i, id(kept[i])) for i in range(ours.start_idx, ours.end_idx)
        ]


def test_a_gemma_4_pipeline_keeps_the_layers_that_reuse_keys_with_the_layer_they_reuse():
    from helpers.sharded import build_target

    from dflash_mlx.base.errors import DFlashError
    from dflash_mlx.models import gemma

    model = build_target("gemma4_kv")  # layer 3 reuses layer 1's keys and values
    assert gemma.pipeline_split(model, 2, None) == [3, 1]
    assert gemma.pipeline_split(model, 2, [3, 1]) == [3, 1]
    assert gemma.pipeline_split(build_target("gemma4"), 2, None) is None  # mlx-lm's even split
    with pytest.raises(DFlashError, match="rank 0 must run its last 3 layers"):
        gemma.pipeline_split(model, 2, [2, 2])
    with pytest.raises(DFlashError, match="use fewer ranks"):
        gemma.pipeline_split(model, 3, None)


def test_max_kv_size_is_refused_on_a_target_we_split():
    # mlx-lm's own pass (that a rotating window is fed by) cannot run the layers of our split.
    from helpers.sharded import build_target

    from dflash_mlx.base.errors import DFlashError
    from dflash_mlx.models.stages import split_decoder
    from dflash_mlx.tools.session import Session

    model = build_target("llama")
    split_decoder(model.model, _Group(0, 2))
    with pytest.raises(DFlashError, match="leave --max-kv-size out"):
        Session(model, None, None).make_cache(max_kv_size=64)


def test_the_compiled_cpu_steps_run_the_layers_of_a_stage_of_our_split():
    from helpers.sharded import build_target

    from dflash_mlx.cpu.speedups import CPU_SPEEDUPS
    from dflash_mlx.models import target as tgt
    from dflash_mlx.models.families import make_target_cache
    from dflash_mlx.models.stages import Stage, split_decoder

    model = build_target("qwen3")
    split_decoder(model.model, _Group(1, 2))  # layers 0 and 1 of 4
    stage, cache = Stage(model.model, 4), make_target_cache(model)
    h = model.model.embed_tokens(mx.array([[5, 6, 7, 8]]))
    steps = tgt._cpu_steps(model, h, cache, tgt._layer_masks(model, h, cache, stage), CPU_SPEEDUPS, stage)
    assert len(cache) == 2 and steps is not None and len(steps) == 2


def test_a_sharded_targets_text_drafts_are_paths_and_rank_0_never_sends_a_tree(qwen3_pair, monkeypatch):
    """The other ranks verify rank 0's drafts as a path, so a sharded target's text drafts build no tree (whether
    one pays is timed, so a tree came only under load and left the ranks' passes apart), and rank 0 sends any tree
    that still comes as its likeliest line."""
    from dflash_mlx import LoopOptions, make_cache
    from dflash_mlx.drafts import build
    from dflash_mlx.drafts.datastore import Datastore
    from dflash_mlx.drafts.free import FreeDrafts
    from dflash_mlx.loop.distributed import LeadProposer, Peers
    from dflash_mlx.loop.proposal import Proposal
    from dflash_mlx.models.tree import DraftTree

    model, draft, tok = qwen3_pair
    options = LoopOptions(datastore=Datastore(None, tok.vocab_size))
    for sharded in (False, True):
        monkeypatch.setattr(build, "target_group", lambda m, s=sharded: object() if s else None)
        proposer, _ = build.make_proposer(model, draft, make_cache(model, draft), options, sampler=None, speedups=None)
        free = proposer.paused
        assert isinstance(free, FreeDrafts) and (free.tree_nodes == 0) == sharded

    tree = DraftTree([5, 6, 7], [-1, 0, 0, 1], [1, 1, 2])

    class Trees:
        tap_ids, drafter = [], None

        def propose(self, last, n):
            return Proposal(mx.array(tree.tokens, dtype=mx.uint32), tree=tree)

    lead = LeadProposer(Trees(), Peers(None, 16))
    lead.peers.decided([1], 0)
    sent = lead.propose(1, 3)
    assert sent.tree is None and sent.tokens.tolist() == tree.first_path() == [5, 7]
