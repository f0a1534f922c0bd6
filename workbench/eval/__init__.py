"""Downstream evaluation of BF16, PTQ and QAT models side by side, with EleutherAI's lm-eval.

    from workbench.eval import run
    res = run(["runs/demo/init", "ptq:mxfp4@runs/demo/init", "runs/demo/run"],
              tasks="wb_code_choice,wb_code_complete", out="runs/demo/eval")
    res.table(); res.recovery

Command line: ``workbench eval MODEL... --tasks T1,T2 [--limit N] --out DIR``. What a MODEL may
be (checkpoint folder, ``ptq:RECIPE@PATH``, run folder, DCP checkpoint): `workbench.eval.refs`;
how it is loaded: `workbench.eval.load`; reading results and recovery (`read_eval`,
`group_eval`, `recovery`, ...): `workbench.track`, beside the runs' other records;
docs/eval.md has the definitions. lm-eval (extra ``eval``) is imported here and nowhere else.
"""

from workbench.eval.errors import EvalError
from workbench.eval.harness import LM_EVAL_VERSION, HarnessOptions
from workbench.eval.launch import EvalRequest, chain_eval
from workbench.eval.load import Loaded, load
from workbench.eval.refs import ModelRef, parse_model, parse_models
from workbench.eval.runner import EvalResult, format_report, run
from workbench.eval.ship import DEFAULT_TOLERANCE, ShipCheck, compare_samples, ship_check
from workbench.eval.taskset import SHIPPED, TASKS_DIR, TaskSet, resolve_tasks

__all__ = [
    "DEFAULT_TOLERANCE",
    "LM_EVAL_VERSION",
    "SHIPPED",
    "TASKS_DIR",
    "EvalError",
    "EvalRequest",
    "EvalResult",
    "HarnessOptions",
    "Loaded",
    "ModelRef",
    "ShipCheck",
    "TaskSet",
    "chain_eval",
    "compare_samples",
    "format_report",
    "load",
    "parse_model",
    "parse_models",
    "resolve_tasks",
    "run",
    "ship_check",
]
