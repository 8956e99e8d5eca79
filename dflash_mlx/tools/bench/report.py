"""The benchmark's report: the stamp every result carries, the Markdown table and the plots."""

import os
import platform
import subprocess
import time
from pathlib import Path

import mlx.core as mx

from ... import __version__
from ...cpu.openblas import blas_in_use
from .timing import DFLASH_METHODS


def git_commit(path: str | Path) -> str:
    """The short commit of the checkout holding ``path``, "+changes" when tracked files differ from it.

    Returns "" outside a git checkout (an installed wheel) or without git.
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=path
        ).stdout.strip()
        if (
            commit
            and subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=path
            ).stdout.strip()
        ):
            # A result measured on edited files (say, new weights) must not pass for the commit's.
            commit += "+changes"
    except OSError:
        commit = ""
    return commit


def stamp() -> dict:
    """Machine, versions, commit and BLAS: every result carries them."""
    import mlx_lm

    commit = git_commit(Path(__file__).parent)
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "dflash_mlx": __version__,
        "commit": commit or "unknown",
        "blas": blas_in_use(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def markdown(rows: list[dict], meta: dict, times: dict) -> str:
    # The limit's columns only where a row has one (dflash, dflash-cut, dflash-auto): a table of
    # other methods would show them empty in every row.
    limits = any("limit" in r for r in rows)
    limit_head = "| limit | efficiency | loop eff. " if limits else ""
    lines = [
        f"Machine: {meta['machine']} ({meta['device']}); BLAS: {meta['blas']}; mlx {meta['mlx']}, "
        f"mlx-lm {meta['mlx_lm']}; commit {meta['commit']}; {meta['date']}"
        + (f"; kernels {meta['kernels']}" if "kernels" in meta else "")
        + (f"; drafter family {meta['draft_family']}" if meta.get("draft_family") else ""),
        "",
        f"| method | block | gen tok/s | speedup | tau | drafting / plain cycles | verified | prompt tok/s {limit_head}"
        "| peak GB |",
        "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if limits else "") + "---|",
    ]
    for r in rows:
        # "-": the row has no such number (see the notes under the table), not a blank to wonder about.
        limit = f"{r['limit']:.2f}x" if "limit" in r else "-"
        eff = f"{100 * r['efficiency']:.0f}%" if r.get("efficiency") is not None else "-"
        loop = f"{100 * r['loop_efficiency']:.0f}%" if "loop_efficiency" in r else "-"
        verified = f"{r['verify_size']:.2f}" if "verify_size" in r else ""
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else ""
        tau = f"{r['tau']:.2f}" if r["drafting_cycles"] else "-"
        cells = f"{limit} | {eff} | {loop} | " if limits else ""
        lines.append(
            f"| {r['method']} | {r['block_size']} | {r['generation_tps']:.1f} | {speedup} | {tau} | "
            f"{r['drafting_cycles']} / {r['plain_cycles']} | {verified} | {r['prompt_tps']:.0f} | {cells}"
            f"{r['peak_memory_gb']:.2f} |"
        )
    lines += [
        "",
        "speedup: generation tok/s over the baseline's. tau: mean acceptance length, the tokens drafting cycles "
        "emitted over the drafting cycles (those that verified at least one draft), pooled over the prompts; "
        "plain cycles (no draft: a prompt-lookup miss, a last cycle with no room, every baseline step) emit one "
        "token each and are counted apart. verified: tokens the "
        "target checked per cycle (dflash-cut stops at the drafter's first draft under --min-confidence). "
        "limit: tau x t_AR / (t_draft + t_verify), with each cycle's verify at its size, the best speedup "
        "over a bare AR step. efficiency: speedup / limit. loop eff.: measured tok/s over the ideal "
        "tau / (t_draft + t_verify), the loop against its own passes timed alone; it differs from efficiency "
        "by the baseline's real step against a lone AR pass (below). "
        "dflash-fallback has no limit: its prompt-lookup cycles run no drafter pass. dflash-default: generate's "
        "defaults (the adaptive policy, one state across the method's runs, warm-up first, as a chat or server "
        "keeps it; while it pauses the drafter, each cycle verifies the tree of prompt lookup's and the datastore's "
        "continuations (up to 12 nodes, 7 deep), or the one path, that its learned chances and this machine's "
        "measured verify costs say gives the most tokens a step, or steps plainly; where the drafter drafts, its "
        "drafts join that tree); no limit. "
        "dflash-tree: a draft tree (DDTree) of up to --tree-budget nodes a cycle, as deep as the drafter's block; "
        "verified counts its nodes and root; no limit.",
    ]
    lines += _per_row(
        rows, "shares", "Accepted drafts by what proposed them (drafter: the DFlash drafter; lookup: prompt lookup; "
        "datastore: the target's past text):", lambda k, v: f"{k} {100 * v:.0f}%", least=2,
    )  # fmt: skip
    lines += _per_row(
        rows, "depths", "Drafts kept by depth (of the drafting cycles that verified d drafts or more, the share that "
        "kept d or more; of a tree, whose accepted path reached depth d):", lambda d, v: f"{d}: {100 * v:.0f}%",
    )  # fmt: skip
    if meta.get("kernel_verdicts"):
        lines += ["", "Metal kernels (what each dispatcher ran at each shape class):"]
        lines += [f"- {v['kernel']} {v['shape']}: {'kernel' if v['enabled'] else 'twin'}, {v['reason']}"
                  for v in meta["kernel_verdicts"]]  # fmt: skip
    if times.get("verify"):
        at = f" at a {times['context']}-token context" if "context" in times else ""
        base = next((r for r in rows if r["method"] == "baseline" and r["generation_tps"] > 0), None)
        own = f" (the baseline's own step: {1e3 / base['generation_tps']:.2f})" if base else ""
        lines += ["", f"Component times (ms){at}: AR step {1e3 * times['ar']:.2f}{own}"]
        for b in sorted(times["verify"]):
            d = times["draft"].get(b)
            line = f"- B={b}: verify {1e3 * times['verify'][b]:.2f}" + (f", draft {1e3 * d:.2f}" if d else "")
            if b in times.get("rollback", {}):
                by_k = sorted(times["rollback"][b].items())
                line += (f", rollback {' / '.join(f'{1e3 * t:.2f}' for _, t in by_k)} "
                         f"at k = {' / '.join(str(k) for k, _ in by_k)} accepted")  # fmt: skip
            lines.append(line)
        if times.get("rollback"):
            lines += [
                "",
                "rollback: rewinding the target's recurrent state after a verify that accepted k drafts (a hybrid "
                "target). The limit and loop eff. add each cycle's rollback, at the k it had, to t_draft + t_verify.",
            ]
    return "\n".join(lines) + "\n"


def _per_row(rows: list[dict], key: str, heading: str, show, least: int = 1) -> list[str]:
    # A line per method and block size whose ``key`` holds at least ``least`` entries, under ``heading``.
    listed = [r for r in rows if len(r.get(key) or {}) >= least]
    if not listed:
        return []
    return ["", heading] + [
        f"- {r['method']} B={r['block_size']}: " + ", ".join(show(k, v) for k, v in r[key].items()) for r in listed
    ]


def plot_caption(meta: dict) -> str:
    """What a plot measured: the model, the drafter and the prompt set."""
    return (
        f"target {meta.get('model')} · drafter {meta.get('draft')}"
        + (f" ({meta['draft_family']})" if meta.get("draft_family") else "")
        + f" · prompts {meta.get('prompt_set')} "
        f"({meta.get('prompts')}) · {meta.get('dtype')}"
    )


def plots(rows: list[dict], out: Path, meta: dict | None = None) -> list[Path]:
    """Speedup and acceptance against block size, and the acceptance histogram, as PNG files,
    captioned with ``meta``'s model, drafter and prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    caption = plot_caption(meta) if meta else None

    out.mkdir(parents=True, exist_ok=True)
    dflash = [r for r in rows if r["method"] == "dflash"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    lines = (
        ("dflash", "DFlash"),
        ("dflash-cut", "DFlash, cut block"),
        ("dflash-fallback", "DFlash, lookup fallback"),
        ("lookup", "prompt lookup"),
    )
    for i, (method, label) in enumerate(lines):
        mine = [r for r in rows if r["method"] == method]
        if mine:
            style = dict(color=f"C{i}", label=label, ls="-" if method in DFLASH_METHODS else ":")
            if mine[0]["speedup"] is not None:
                ax[0].plot([r["block_size"] for r in mine], [r["speedup"] for r in mine], "o", **style)
            ax[1].plot([r["block_size"] for r in mine], [r["tau"] for r in mine], "o", **style)
    refs = (r for r in rows if r["method"] in ("baseline", "mlx-spec") and r["speedup"] is not None)
    for i, r in enumerate(refs):
        ax[0].axhline(r["speedup"], ls="--", lw=1, color=f"C{len(lines) + i}", label=r["method"])
    ax[0].set(xlabel="block size", ylabel="speedup vs baseline", title="Speedup")
    if ax[0].get_legend_handles_labels()[0]:
        ax[0].legend(fontsize=7)
    else:
        ax[0].text(0.5, 0.5, "no baseline run", ha="center", va="center", transform=ax[0].transAxes)
    ax[1].legend(fontsize=7)
    ax[1].set(xlabel="block size", ylabel="mean acceptance length", title="Acceptance")
    for a in ax:  # block sizes are whole numbers
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if caption:
        fig.suptitle(caption, fontsize=7)
    fig.tight_layout()
    paths = [out / "speedup.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    if dflash:
        best = max(dflash, key=lambda r: r["block_size"])
        fig, ax = plt.subplots(figsize=(5, 3.5))
        hist = best["histogram"]
        ax.bar(list(hist), list(hist.values()))
        ax.set(
            xlabel="acceptance length (tokens per drafting cycle)",
            ylabel="drafting cycles",
            title=f"DFlash B={best['block_size']}",
        )
        # Both axes count things: whole tokens and whole cycles.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if caption:
            fig.suptitle(caption, fontsize=7)
        fig.tight_layout()
        paths.append(out / "acceptance_histogram.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
