"""Where a sampled DFlash cycle's time goes on MLX's CPU backend, next to a plain decoding step.

Runs the embedded pair (fp32) through the cycle's stages one at a time, each evaluated on its
own so that it can be timed: the drafter pass, the drafter's distribution q, the draws from
it, the target's verify pass, the target's distribution p, and the acceptance test (and a
plain step: a one-token target pass and its draw). The sampling stages are timed twice: as
dflash_mlx computes them now (one softmax per row set straight from the logits, inverse-CDF
draws, the polynomial exp with the CPU speedups), and as it computed them before (a
logsumexp, then a softmax; a log and a Gumbel draw for each categorical). Real cycles overlap
the stages and have one host synchronisation; this splits them to show which cost what.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_CORETYPE=SkylakeX \\
        python recipes/measure/profile_sampling.py --block-sizes 2 4 16 --temp 0.6
"""

import argparse
import statistics
import time

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.cpu.speedups import choose_speedups
from dflash_mlx.loop.cache import make_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.sampling import make_sampler, sample_rows, speculative_accept


def _old_probs(sampler, logits):
    return sampler.probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _old_accept(draft_tokens, q, p):
    k = draft_tokens.shape[0]
    rows = mx.arange(k)
    accepted = mx.random.uniform(shape=(k,)) * q[rows, draft_tokens] < p[rows, draft_tokens]
    residual = mx.maximum(p[:k] - q, 0.0)
    total = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[:k])
    return accepted, mx.random.categorical(mx.log(mx.concatenate([residual, p[k:]], axis=0)))


def _timed(fn):
    tic = time.perf_counter()
    out = fn()
    mx.eval(out)
    return out, (time.perf_counter() - tic) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--temp", type=float, default=0.6)
    parser.add_argument("--context", type=int, default=150, help="Committed tokens before the timed cycles.")
    parser.add_argument("--cycles", type=int, default=40, help="Timed cycles per block size (median).")
    args = parser.parse_args()

    model, draft, _ = load(dtype="float32")
    speedups = choose_speedups(mx.float32)
    kernel = speedups is not None and speedups.fast_exp
    sampler = make_sampler(args.temp)
    print(f"embedded pair fp32, vocab {model.args.vocab_size}, context {args.context}, temp {args.temp}, "
          f"CPU speedups {'on' if speedups else 'off'}; median ms over {args.cycles} cycles")  # fmt: skip
    for block_size in args.block_sizes:
        n = block_size - 1
        cache = make_cache(model, draft)
        ids = mx.random.randint(0, model.args.vocab_size, (args.context,)).tolist()
        logits, taps = tgt.forward_with_taps(model, mx.array(ids)[None], cache.target, draft.target_layer_ids, speedups)
        cache.append_pending(taps)
        cache.tokens.extend(ids)
        mx.eval(logits, cache.pending_taps)
        times = {}
        for cycle in range(args.cycles + 3):
            row = {}
            block = mx.array([[ids[-1]] + [draft.mask_token_id] * (draft.block_size - 1)], dtype=mx.uint32)
            d_logits, row["drafter pass"] = _timed(
                lambda: draft.propose(model, block, cache.take_pending(), cache.draft, speedups=speedups)[0, :n]
            )
            q, row["q = probs (now)"] = _timed(lambda: sampler.probs(d_logits, fast_exp=kernel))
            _, row["q = probs (before)"] = _timed(lambda: _old_probs(sampler, d_logits))
            drafts, row["draws (now)"] = _timed(lambda: sample_rows(q))
            _, row["draws (before)"] = _timed(lambda: mx.random.categorical(mx.log(q)).astype(mx.uint32))
            verified = mx.concatenate([mx.array([ids[-1]], dtype=mx.uint32), drafts])[None]
            (t_logits, t_taps), row["verify pass"] = _timed(
                lambda: tgt.forward_with_taps(model, verified, cache.target, draft.target_layer_ids, speedups)
            )
            p, row["p = probs (now)"] = _timed(lambda: sampler.probs(t_logits[0], fast_exp=kernel))
            _, row["p = probs (before)"] = _timed(lambda: _old_probs(sampler, t_logits[0]))
            (passed, tokens), row["accept (now)"] = _timed(lambda: speculative_accept(drafts, q, p))
            _, row["accept (before)"] = _timed(lambda: _old_accept(drafts, q, p))
            tic = time.perf_counter()
            passed, tokens = passed.tolist(), tokens.tolist()
            row["host sync"] = (time.perf_counter() - tic) * 1e3
            # Keep the whole block, so that every cycle verifies the same size.
            cache.tokens.extend(verified[0].tolist())
            cache.append_pending(t_taps)
            ids = ids + drafts.tolist() + tokens[-1:]
            # A plain step: one token through the target, its draw from p.
            plain = mx.array([[ids[-1]]], dtype=mx.uint32)
            (s_logits, _), row["plain: 1-token pass"] = _timed(
                lambda: tgt.forward_with_taps(model, plain, cache.target, [], speedups)
            )
            _, row["plain: draw (now)"] = _timed(lambda: sample_rows(sampler.probs(s_logits[0], fast_exp=kernel)))
            _, row["plain: draw (before)"] = _timed(
                lambda: sampler(s_logits[0] - mx.logsumexp(s_logits[0], axis=-1, keepdims=True))
            )
            cache.trim_target(1)
            if cycle >= 3:
                for name, ms in row.items():
                    times.setdefault(name, []).append(ms)
        print(f"\nblock {block_size} ({n} drafts)")
        for name, ms in times.items():
            print(f"  {name:22s} {statistics.median(ms):7.3f}")


if __name__ == "__main__":
    main()
