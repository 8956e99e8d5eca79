"""dflash-train's command line: one flag per ``TrainingArgs`` field, checked before anything loads."""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ...base.dtypes import DTYPES
from ...base.errors import DFlashError
from ..cli.options import ArgumentParser, add_blas_argument
from .checkpoint import TrainingInterrupted, latest_checkpoint
from .config import TrainingArgs, check_args
from .trainer import train


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    # A help text that already says its default (or has none worth saying) is shown as it is.
    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash drafter for an mlx-lm target.",
        formatter_class=_HelpFormatter,
    )
    for f in dataclasses.fields(TrainingArgs):
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.name == "target_layer_ids":
            parser.add_argument(flag, type=int, nargs="+", default=None, help=help_text)
        else:
            kind = next((t for t in (int, float) if f.type is t or t in getattr(f.type, "__args__", ())), str)
            choices = {"responses": ["generate", "dataset"], "dtype": list(DTYPES)}
            parser.add_argument(flag, type=kind, default=f.default, help=help_text, choices=choices.get(f.name))
    add_blas_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = setup_arg_parser()
    args = vars(parser.parse_args(argv))
    args.pop("blas")  # used by the console script before anything loaded
    try:
        check_args(TrainingArgs(**args))
    except DFlashError as e:
        parser.error(str(e))  # a bad value exits 2, as in the other tools
    try:
        train(TrainingArgs(**args))
    except DFlashError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        sys.exit(1)
    except TrainingInterrupted as e:
        print(f"dflash-train: interrupted at step {e.step}; saved to {e.out}; rerun with --resume to continue",
              file=sys.stderr)  # fmt: skip
        sys.exit(130)
    except KeyboardInterrupt:
        checkpoint = latest_checkpoint(Path(args["out"])) if Path(args["out"]).is_dir() else None
        if checkpoint is None:
            saved = "no checkpoint saved (the response cache keeps the responses generated so far)"
        else:
            step = json.loads((checkpoint[0] / "state.json").read_text())["step"]
            saved = f"the last checkpoint in {args['out']} is at step {step}; rerun with --resume to continue"
        print(f"dflash-train: interrupted; {saved}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
