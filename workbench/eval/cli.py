"""`workbench eval MODEL... --tasks T1,T2 [--limit N] --out DIR`: see docs/eval.md.

Input the user can fix (an unknown task, a missing data file, a model the workbench cannot
read, a bad option) is one `error: ...` line on stderr and exit code 2, never a traceback.
`workbench.cli` hands the arguments after `eval` to `main`, so the other subcommands never
import lm-eval; a Slurm job runs `job` with the same arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from workbench.checkpoint import CheckpointError
from workbench.eval.errors import EvalError
from workbench.eval.runner import run
from workbench.track.evals import EvalFileError

HELP_MODEL = ("checkpoint folder (BF16 or packed), ptq:RECIPE@PATH (PATH fake-quantized with "
              "RECIPE), a trainer run folder, or a run's checkpoints/step_N")


def _limit(text: str) -> int | float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    return int(v) if v >= 1 and v.is_integer() else v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="workbench eval",
        description="Evaluate models on lm-eval tasks with its HF backend, on the same "
                    "documents; writes DIR/eval.json, a table per task x model with stderr, "
                    "and recovery (docs/eval.md).")
    p.add_argument("models", nargs="+", metavar="MODEL", help=HELP_MODEL)
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task names (shipped: wb_code_choice, "
                        "wb_code_complete; registry tasks need their data in the HF cache)")
    p.add_argument("--out", required=True, help="folder for eval.json, tables and samples")
    p.add_argument("--limit", type=_limit, default=None,
                   help="first N documents of each task (every model sees the same ones)")
    p.add_argument("--num-fewshot", type=int, default=None, help="default: each task's own")
    p.add_argument("--include", action="append", default=[],
                   help="folder of lm-eval task YAMLs (repeatable); relative data files are "
                        "read from the YAML's folder")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if present)")
    p.add_argument("--dtype", default="auto",
                   help="checkpoint folders: auto (float32 on CPU, bfloat16 on GPU), float32, "
                        "bfloat16, float16")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for every model")
    p.add_argument("--cache", default=None,
                   help="folder of BF16/PTQ rows shared by the runs of a group (reused)")
    p.add_argument("--no-record", action="store_true",
                   help="do not write eval columns into the evaluated runs' metrics and wandb")
    return p


def _run(args: argparse.Namespace) -> Any:
    return run(args.models, args.tasks, out=args.out, limit=args.limit,
               num_fewshot=args.num_fewshot, include=args.include, device=args.device,
               dtype=args.dtype, batch_size=args.batch_size, tokenizer=args.tokenizer,
               record_runs=not args.no_record, cache=args.cache)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _run(args)
    except (EvalError, CheckpointError) as e:
        print(f"error: {e.one_line()}", file=sys.stderr, flush=True)
        return 2
    except EvalFileError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def job(argv: list[str]) -> dict[str, Any]:
    """The Slurm job's entry (`workbench.eval.launch`): the same arguments; a failure raises
    (the job ends FAILED with the message in its log); returns where the results are."""
    res = _run(parser().parse_args(argv))
    return {"eval": str(res.out / "eval.json"), "models": [m["label"] for m in res.eval["models"]]}


if __name__ == "__main__":
    sys.exit(main())
