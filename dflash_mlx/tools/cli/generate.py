"""dflash-generate: one prompt through the library's generation, printed as it streams."""

import sys

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ...base.errors import DFlashError
from ...models.drafter import DraftModel
from ...sampling import make_sampler
from ...text.chat_template import has_chat_template, render_chat
from ...text.inputs import MAX_SEED, check_text, decode_utf8
from ...tuning.policy import PolicyStore
from .options import (
    ArgumentParser,
    InRange,
    add_blas_argument,
    add_decoding_arguments,
    add_kernels_argument,
    add_model_arguments,
    add_parallel_arguments,
    add_window_arguments,
    block_size_problem,
    boolean_words,
    str2bool,
)
from .progress import prefill_progress


def setup_arg_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="dflash-generate", description="Generate text with DFlash speculative decoding.")
    add_model_arguments(parser)
    add_parallel_arguments(parser)
    add_blas_argument(parser)
    add_kernels_argument(parser)
    parser.add_argument("--prompt", "-p", default="Hello", help="The prompt ('-' reads stdin; default: 'Hello').")
    add_decoding_arguments(parser, max_tokens=256)
    add_window_arguments(parser)
    parser.add_argument(
        "--top-p", type=float, action=InRange, low=0.0, high=1.0, default=0.0,
        help="Nucleus sampling threshold (default: 0, off).",
    )  # fmt: skip
    parser.add_argument(
        "--top-k", type=int, action=InRange, low=0, default=0,
        help="Sample from the k most likely tokens (default: 0, off).",
    )  # fmt: skip
    parser.add_argument(
        "--min-p", type=float, action=InRange, low=0.0, high=1.0, default=0.0,
        help="Min-p sampling threshold (default: 0, off).",
    )  # fmt: skip
    parser.add_argument(
        "--repetition-penalty", type=float, action=InRange, low=0.0, low_open=True, default=None,
        help="Penalty for repeating recent tokens, e.g. 1.1 (default: none).",
    )  # fmt: skip
    parser.add_argument(
        "--proposal", choices=["greedy", "sample"], default="sample",
        help="How the drafter proposes when sampling (default: sample).",
    )  # fmt: skip
    parser.add_argument(
        "--adaptive",
        type=boolean_words(("true",), ("false",)),
        default=None,
        metavar="{true,false}",
        help="Pause the drafter while drafting is measured slower than decoding without it, drafting again "
        "later (same distribution; default: true, false with --seed, whose output would depend on timings). What "
        "it measured is kept per pair, setup and machine in ~/.cache/dflash-mlx/policy.json, where the next run "
        "goes on from it, timing the drafter again after at most one window of a pause it carries over.",
    )
    parser.add_argument(
        "--paused-lookup",
        type=int,
        action=InRange,
        low=0,
        default=1,
        metavar="N",
        help="While --adaptive pauses the drafter, verify up to N prompt-lookup drafts a cycle (no drafter pass; "
        "default: 1, which a small target verifies at about a plain step's cost; 0: plain steps).",
    )
    parser.add_argument("--seed", type=int, action=InRange, low=0, high=MAX_SEED, default=None,
                        help="Random seed for sampling (default: none).")  # fmt: skip
    parser.add_argument(
        "--ignore-chat-template", action="store_true", help="Use the prompt as is, without the chat template."
    )
    parser.add_argument(
        "--hide-reasoning", action="store_true",
        help="Print only the answer of a reasoning model (gpt-oss's final channel, the text after </think>), "
        "not its reasoning, which is otherwise printed first under 'Reasoning:'. With --verbose F only the "
        "answer is printed either way.",
    )  # fmt: skip
    parser.add_argument(
        "--max-kv-size", type=int, action=InRange, low=1, default=None,
        help="Keep only the last this many tokens' keys and values (a rotating cache), with --no-draft: "
        "DFlash rolls back rejected drafts, which a rotating cache cannot (default: no limit).",
    )  # fmt: skip
    parser.add_argument(
        "--verbose", type=str2bool, nargs="?", const=True, default=True,
        help="True/T (or the bare flag): the text as it streams, then the statistics (tau = tokens per drafting "
        "cycle, the mean acceptance length); False/F: only the text (default: True).",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    from ...loading.registry import loaded_names
    from ..session import Session

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    try:
        # Bytes, decoded here: a stream that is not UTF-8 is one line, not a tokenizer's traceback.
        prompt = decode_utf8(sys.stdin.buffer.read()) if args.prompt == "-" else args.prompt
        check_text(prompt, "--prompt" if args.prompt != "-" else "stdin")
    except DFlashError as e:
        parser.error(str(e))
    if not prompt:
        if args.prompt == "-":
            parser.error("--prompt - read nothing: stdin was empty; pipe or type at least one character.")
        parser.error("--prompt is empty: pass at least one character.")
    loaded = False
    try:
        if args.pipeline_split is not None and args.parallel != "pipeline":
            parser.error("--pipeline-split needs --pipeline.")
        session = Session.open(args.model, args.draft, no_draft=args.no_draft, dtype=args.dtype, kernels=args.kernels,
                               parallel=args.parallel, pipeline_split=args.pipeline_split,
                               extra_eos_token=args.extra_eos_token, policy_store=PolicyStore())  # fmt: skip
        loaded = True
        draft, tokenizer = session.draft, session.tokenizer
        # Under mlx.launch every rank generates (its share of each target pass); rank 0 prints.
        leads = mx.distributed.init().rank() == 0
        if draft is None and not args.no_draft and leads:
            print(
                "dflash-generate: no drafter given or known for this target: plain decoding (pass --draft for DFlash).",
                file=sys.stderr,
            )
        problem = block_size_problem(args.block_size, draft.block_size if draft is not None else None)
        if problem:
            raise DFlashError(problem)
        if args.max_kv_size is not None and draft is not None:
            raise DFlashError(
                "--max-kv-size needs plain decoding (--no-draft): DFlash rolls back the cache after a "
                "rejected draft, which a rotating cache cannot do once it is full."
            )
        # A reply to a chat prompt may carry reasoning; a raw prompt's text is left as it comes.
        parse_reasoning = not args.ignore_chat_template and has_chat_template(tokenizer)
        if not args.ignore_chat_template:
            prompt = render_chat(tokenizer, [{"role": "user", "content": prompt}], system_prompt=args.system_prompt,
                                 template_args=args.chat_template_config)  # fmt: skip
        cache = session.make_cache(max_kv_size=args.max_kv_size) if args.max_kv_size is not None else None
        session.open_datastore(args.datastore)
        # One-shot runs go on from what earlier ones measured of this pair on this machine.
        adaptive = args.seed is None if args.adaptive is None else args.adaptive
        setup = None
        if adaptive and isinstance(draft, DraftModel):
            setup = {k: getattr(args, k) for k in ("block_size", "temp", "top_p", "min_p", "top_k", "proposal",
                                                   "min_confidence", "confidence_threshold", "lookup_fallback",
                                                   "draft_window", "paused_lookup", "datastore", "tree_budget")}  # fmt: skip
            session.policy(setup, lookup=args.paused_lookup)  # made (or read) with the paused cycles' lookup
        if args.verbose and leads:  # once every value is known good: a refused run prints nothing
            target_name, draft_name = loaded_names(args.model, None if draft is None else session.draft_path)
            print(f"Target: {target_name}")
            print(f"Drafter: {draft_name or 'none (plain decoding)'}")
        text = session.generate(
            prompt,
            verbose=args.verbose and leads,
            show_reasoning=not args.hide_reasoning,
            parse_reasoning=parse_reasoning,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            sampler=make_sampler(args.temp, args.top_p, args.min_p, args.top_k),
            logits_processors=make_logits_processors(repetition_penalty=args.repetition_penalty),
            proposal=args.proposal,
            min_confidence=args.min_confidence,
            confidence_threshold=args.confidence_threshold,
            lookup_fallback=args.lookup_fallback,
            tree_budget=args.tree_budget,
            adaptive=args.adaptive,
            setup=setup,
            draft_window=args.draft_window,
            draft_sinks=args.draft_sinks,
            seed=args.seed,
            prompt_cache=cache,
            # mlx-lm's prefill step: with a rotating window (--max-kv-size) the chunks shape the output.
            prefill_step_size=2048 if cache is not None else 512,
            # A long prompt's prefill shows a bar on stderr instead of minutes of silence.
            prompt_progress_callback=prefill_progress() if args.verbose and leads else None,
            kernels=args.kernels,
        )
        if leads:
            session.keep_policies()
        if not args.verbose and leads:
            print(text)  # the text alone, as mlx_lm.generate does
    except DFlashError as e:
        if loaded:
            from ...loading.watch import end_load_watch

            end_load_watch()  # after the load every rank refuses alike: they stop together, none went away
        print(f"dflash-generate: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
