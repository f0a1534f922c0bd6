"""The README's demo: the workbench's notebooks, executed headless on the embedded default.

    make demo                     # or: .venv/bin/python jobs/demo.py [--out runs/demo-notebooks]

1. builds the embedded demo checkpoint once (``workbench.demo``: a small MoE with structured
   experts, trained a few MXFP4 QAT steps by the workbench trainer, exported packed);
2. runs ``01_inspect_checkpoint`` on it (per-expert error heatmaps, recipe comparison, picker);
3. runs ``02_launch_qat`` (a BF16 baseline and an MXFP4+MXFP8 QAT run, EP4, local executor),
   ``03_budgets`` on the runs it made (curves and budget verdicts), ``04_compare`` on their
   exports (QAT vs the BF16 baseline, expert by expert) and ``05_expert_telemetry`` on the
   per-expert statistics the QAT run recorded while it trained (error, load and code churn per
   expert and step).
4. evaluates the demo's BF16 model, its MXFP4 post-training quantization and the QAT run on the
   two local tasks that ship with the workbench (the README's "Evaluate" table): the command
   ``workbench eval`` runs, results in ``--out``/eval.
Executed notebooks and figures land under ``--out``; the paths are printed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(name: str, out: Path, parameters: dict) -> Path:
    import papermill

    dst = out / name
    t0 = time.time()
    print(f"executing notebooks/{name} ...", flush=True)
    papermill.execute_notebook(str(ROOT / "notebooks" / name), str(dst), parameters=parameters,
                               cwd=str(ROOT), kernel_name="python3", progress_bar=False,
                               log_output=False)
    print(f"  done in {time.time() - t0:.0f} s -> {dst}")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo-notebooks", help="folder for executed notebooks")
    ap.add_argument("--steps", type=int, default=24, help="QAT steps of the demo checkpoint")
    ap.add_argument("--launch-steps", type=int, default=30, help="steps of the 02 notebook's runs")
    ap.add_argument("--skip-launch", action="store_true", help="only the inspection notebook")
    ap.add_argument("--skip-eval", action="store_true", help="no task evaluation at the end")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from workbench.demo import demo_checkpoint

    demo = demo_checkpoint(steps=args.steps)
    print(f"embedded checkpoint: {demo.packed} (reference: the QAT run's BF16 export "
          f"{demo.reference})")
    done = [run_notebook("01_inspect_checkpoint.ipynb", out,
                         {"checkpoint": str(demo.packed), "reference": str(demo.reference),
                          "out_dir": str(out / "inspect"), "demo_steps": args.steps})]
    if not args.skip_launch:
        runs = out / "runs"
        # each demo run launches fresh runs: the trainer refuses to start over a folder that
        # already holds checkpoints (it would silently mix two runs otherwise)
        shutil.rmtree(runs, ignore_errors=True)
        done.append(run_notebook("02_launch_qat.ipynb", out,
                                 {"out": str(runs), "steps": args.launch_steps}))
        done.append(run_notebook("03_budgets.ipynb", out, {"group_dir": str(runs)}))
        # 02's exports fed straight into the comparison: QAT vs BF16 baseline, per expert
        done.append(run_notebook("04_compare.ipynb", out, {"group_dir": str(runs),
                                                           "out_dir": str(out / "compare")}))
        # what the QAT run recorded per expert while it trained (the bf16 baseline records none)
        done.append(run_notebook("05_expert_telemetry.ipynb", out, {"group_dir": str(runs)}))
    if not args.skip_eval:
        from workbench.eval.cli import main as eval_main

        # the BF16 model, its PTQ with the run's recipe and the QAT run, on the shipped tasks
        print("evaluating the demo's BF16 model, its MXFP4 PTQ and the QAT run ...", flush=True)
        rc = eval_main([str(demo.init), f"ptq:mxfp4@{demo.init}", str(demo.run), "--tasks",
                        "wb_code_choice,wb_code_complete", "--out", str(out / "eval"),
                        "--no-record"])
        if rc:
            return rc
    figs = sorted((out / "inspect").glob("*.png"))
    print("\nexecuted notebooks (open them in JupyterLab):")
    for p in done:
        print(f"  {p}")
    print(f"figures and tables: {out / 'inspect'} ({len(figs)} PNGs, experts.csv, summary.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
