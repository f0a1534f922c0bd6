"""The ``workbench`` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import sys


def _inspect(args) -> int:
    from workbench.analysis.inspect import inspect_checkpoint, write_report
    from workbench.checkpoint import open_checkpoint
    from workbench.report import inspect_figures

    ck = open_checkpoint(args.checkpoint)
    ref = open_checkpoint(args.reference) if args.reference else None
    print(ck)
    print(ck.scope.summary(ck.logical_names(), max_rows=0))
    result = inspect_checkpoint(ck, args.recipe or None, ref, device=args.device)
    result.figures = inspect_figures(result)  # lossless recipes are named, not drawn
    out = write_report(result, args.out)
    print(result.summary)
    print(f"\nwrote {out}/experts.csv, scales.csv, summary.txt and {len(result.figures)} figures")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workbench", description="MoE QAT workbench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="per-expert quantization error of a checkpoint")
    p.add_argument("checkpoint", help="folder with model.safetensors[.index.json] and config.json")
    p.add_argument("--recipe", action="append", help="FORMAT[:PROFILE], repeatable (e.g. mxfp4:floor)")
    p.add_argument("--reference", help="BF16 checkpoint to measure the stored weights against")
    p.add_argument("--out", default="inspect-out", help="folder for experts.csv, figures, summary")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=_inspect)
    from workbench.compare_cli import add_parser as add_compare

    add_compare(sub)
    args = ap.parse_args(argv)
    from workbench.checkpoint import CheckpointError

    try:
        return args.func(args)
    except CheckpointError as e:
        print(f"workbench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
