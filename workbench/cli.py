"""The ``workbench`` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import sys

from workbench.compare_cli import add_parser as add_compare
from workbench.compare_cli import add_selection, one_line
from workbench.recipe import parse_qat_recipe
from workbench.source import SourceError, resolve


def _selection(args):
    from workbench.checkpoint.select import Selection

    try:
        return Selection.of(args.layers, args.experts)
    except ValueError as e:
        raise ArgError(f"--layers/--experts: {e}") from None


class ArgError(ValueError):
    """A command-line value that cannot work; reported before anything is read."""


def _inspect(args) -> int:
    from workbench.analysis.inspect import (
        check_args,
        inspect_checkpoint,
        nonfinite_line,
        write_report,
    )
    from workbench.checkpoint import open_checkpoint
    from workbench.report import inspect_figures, source_lines

    args.recipe, args.device, args.out = check_args(args.recipe, args.device, args.out)
    select = _selection(args)
    ck = open_checkpoint(args.checkpoint)
    ref = open_checkpoint(args.reference) if args.reference else None
    try:
        select.check(ck.expert_records(), str(ck.path))
    except ValueError as e:
        raise ArgError(str(e)) from None
    print(ck)
    print(ck.scope.summary(ck.logical_names(), max_rows=0))
    result = inspect_checkpoint(ck, args.recipe or None, ref, device=args.device, select=select)
    result.summary = "\n".join([*source_lines(ck, ref, select), result.summary])
    result.figures = inspect_figures(result)  # lossless recipes are named, not drawn
    out = write_report(result, args.out)
    print(result.summary)
    print(f"\nwrote {out}/experts.csv, scales.csv, summary.txt and {len(result.figures)} figures")
    # A finding, not a failed command: the report is complete (exit 0), and this line on stderr
    # is what a script or CI log shows even when stdout is discarded.
    warn = nonfinite_line(result.tables.experts)
    if warn:
        print(f"warning: {warn}", file=sys.stderr)
    return 0


def _plan(args) -> int:
    from workbench.train.plan import PRESETS, PlanError, model_config_of, plan

    try:
        for flag in ("gpus", "gpus_per_node", "batch", "seq", "ep", "fsdp", "layers"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise PlanError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
        if not args.gpu_mem_gib > 0:
            raise PlanError(f"--gpu-mem-gib must be > 0, got {args.gpu_mem_gib}")
        recipe = parse_qat_recipe(args.recipe)  # RecipeError (a ValueError) names the grammar
        model = args.model
        if model not in PRESETS:
            src = resolve(model, need="config")
            if src.kind != "local":
                print(src.describe())
            model = str(src.path)
        cfg = model_config_of(model)
        if args.layers:
            cfg = cfg.with_layers(args.layers)
        gpn = args.gpus_per_node or min(args.gpus, 8)
        if args.gpus % gpn:
            raise PlanError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {gpn}")
        p = plan(cfg, args.gpus // gpn, gpn, args.gpu_mem_gib, batch=args.batch, seq=args.seq,
                 ep=args.ep, fsdp=args.fsdp, act_ckpt=args.activation_checkpointing,
                 qat=not recipe.is_bf16)
    except (PlanError, ValueError) as e:  # SourceError is a ValueError
        print(f"workbench {args.cmd}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    print(p)
    return 0 if p.fits else 1


def _train(args) -> int:
    import os

    from workbench.train.args import config_from_args

    # The command line first, torch-free: --help and a refused flag load nothing heavy.
    config_from_args(args.argv, prog="workbench train")
    # torchao (which transformers may import) skips its compiled extensions, built for another
    # torch.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from workbench.train.cli import console

    console(args.argv, prog="workbench train")


def _eval(args) -> int:
    from workbench.eval.cli import main as eval_main  # lm-eval loads only for this subcommand

    return eval_main(args.argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workbench", description="MoE QAT workbench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    # Every flag after `train` is the trainer's own (workbench.train.args, --help included): this
    # parser takes none of them (no prefix character it would recognise), the trainer's parses all.
    p = sub.add_parser("train", help="run the QAT trainer (one process; torchrun -m "
                       "workbench.train.cli for several)", add_help=False, prefix_chars="\0")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=_train)
    p = sub.add_parser("inspect", help="per-expert quantization error of a checkpoint")
    p.add_argument("checkpoint", help="folder with model.safetensors[.index.json] and "
                   "config.json, hub id ORG/NAME[@REVISION], or URL (https://, hf://, s3://)")
    p.add_argument("--recipe", action="append", help="FORMAT[:PROFILE], repeatable (e.g. mxfp4:floor)")
    p.add_argument("--reference", help="BF16 checkpoint (folder, hub id or URL) to measure the "
                   "stored weights against")
    add_selection(p)
    p.add_argument("--out", default="inspect-out", help="folder for experts.csv, figures, summary")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("plan", help="per-rank memory of a QAT run and the smallest layouts that fit")
    p.add_argument("model", help="model preset name, checkpoint folder with config.json, or "
                   "hub id ORG/NAME[@REVISION]")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all (nodes x gpus per node)")
    p.add_argument("--gpus-per-node", type=int, help="default: min(--gpus, 8)")
    p.add_argument("--gpu-mem-gib", type=float, default=141.0, help="memory per GPU (H200: 141)")
    p.add_argument("--batch", type=int, default=32, help="global batch in sequences")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--ep", type=int, help="expert-parallel size (default: world / fsdp)")
    p.add_argument("--fsdp", type=int, default=1, help="FSDP size (world = ep x fsdp)")
    p.add_argument("--layers", type=int, help="override num_layers (presets keep 4 by default)")
    p.add_argument("--recipe", default="mxfp4", help="bf16 for a baseline (no fake-quant copies)")
    p.add_argument("--activation-checkpointing", default="off",
                   choices=("off", "full", "selective"))
    p.set_defaults(func=_plan)
    add_compare(sub)
    # Every word after "eval" (options too: no prefix char is "-") goes to workbench.eval.cli.
    p = sub.add_parser("eval", add_help=False, prefix_chars="\0", help="downstream evaluation "
                       "(lm-eval) of BF16, PTQ and QAT models side by side (workbench eval --help)")
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=_eval)
    args = ap.parse_args(argv)
    from workbench.analysis.inspect import InspectArgError
    from workbench.checkpoint import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, InspectArgError, SourceError, ArgError) as e:
        msg = e.one_line() if isinstance(e, CheckpointError) else one_line(str(e))
        print(f"workbench {args.cmd}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
