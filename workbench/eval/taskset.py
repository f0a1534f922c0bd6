"""Which lm-eval tasks to run: local YAML tasks (the shipped ones and `--include` folders) and
the harness's own registry, resolved before any model is loaded.

Local tasks are lm-eval YAML files whose data are local files (``dataset_path: json`` / ``csv`` /
``parquet`` with ``dataset_kwargs.data_files``). Relative data paths are resolved against the
YAML's own folder, so a task folder works from any working directory (lm-eval alone resolves
them against its working directory: run it from the task folder to get the same files). A task
folder is code in lm-eval's sense (``!function`` entries import Python next to the YAML): include
only folders you would import.

Registry tasks (``gsm8k``, ``mmlu_pro``, ...) run when their datasets are in the local Hugging
Face cache (offline: ``HF_DATASETS_OFFLINE=1``); one that is not fails here, naming the task.
Indexing the registry takes seconds, so it is only built when a task is not local.
"""

from __future__ import annotations

import copy
import difflib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.eval.errors import EvalError

try:
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("workbench.eval needs lm-eval: pip install 'workbench[eval]'") from e

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SHIPPED = ("wb_code_choice", "wb_code_complete")
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
log = logging.getLogger(__name__)


@dataclass
class TaskSet:
    """The tasks of one evaluation: `specs` go to lm-eval's `TaskManager.load` (a dict for a
    local task, its name for a registry one), the same for every model."""

    names: tuple[str, ...]
    specs: list[str | dict[str, Any]]
    include: tuple[Path, ...]
    manager: Any  # the lm-eval TaskManager the specs resolve against
    sources: dict[str, str] = field(default_factory=dict)  # task -> YAML file or "registry"


def parse_task_list(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    parts = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(p.strip() for p in parts if p and p.strip()))
    if not names:
        raise EvalError("--tasks is empty: name at least one task (e.g. "
                        f"{','.join(SHIPPED)})")
    return names


def _local_paths(cfg: dict[str, Any], yaml_dir: Path, task: str) -> dict[str, Any]:
    """cfg with relative local data paths made absolute against `yaml_dir`; EvalError when a
    local data file is missing."""
    cfg = copy.deepcopy(cfg)
    kwargs = cfg.get("dataset_kwargs") or {}
    if cfg.get("dataset_path") in LOCAL_BUILDERS:
        files = kwargs.get("data_files")
        if not files:
            raise EvalError(f"task {task}: dataset_path {cfg['dataset_path']!r} needs "
                            "dataset_kwargs.data_files (the local files to read)")

        def fix(p: Any) -> str:
            q = Path(str(p)).expanduser()
            q = q if q.is_absolute() else yaml_dir / q
            if not q.is_file():
                raise EvalError(f"task {task}: data file {q} does not exist")
            return str(q)

        if isinstance(files, dict):
            kwargs["data_files"] = {k: [fix(x) for x in v] if isinstance(v, list) else fix(v)
                                    for k, v in files.items()}
        elif isinstance(files, list):
            kwargs["data_files"] = [fix(x) for x in files]
        else:
            kwargs["data_files"] = fix(files)
        cfg["dataset_kwargs"] = kwargs
    elif isinstance(cfg.get("dataset_path"), str):
        local = yaml_dir / cfg["dataset_path"]
        if not Path(cfg["dataset_path"]).is_absolute() and local.exists():
            cfg["dataset_path"] = str(local)  # a dataset folder next to the YAML
    return cfg


def resolve_tasks(tasks: str | list[str] | tuple[str, ...],
                  include: list[str | Path] | tuple[str | Path, ...] = ()) -> TaskSet:
    """Resolve task names against the shipped tasks, `include` folders and (only if needed)
    lm-eval's registry; EvalError names an unknown task (with close matches) or a missing file."""
    names = parse_task_list(tasks)
    folders = [TASKS_DIR]
    for inc in include:
        p = Path(inc).expanduser()
        if not p.is_dir():
            raise EvalError(f"--include {inc}: not a folder of lm-eval task YAML files")
        folders.append(p.resolve())
    local = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    manager = local
    missing = [n for n in names if n not in local.all_tasks]
    if missing:
        log.info("indexing lm-eval's task registry for %s", ", ".join(missing))
        manager = TaskManager(include_path=[str(f) for f in folders])
        unknown = [n for n in missing if n not in manager.all_tasks]
        if unknown:
            n = unknown[0]
            close = difflib.get_close_matches(n, manager.all_tasks, n=3)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise EvalError(f"unknown task {n!r}: not in lm-eval's registry nor in "
                            f"{', '.join(map(str, folders))}{hint}")
    specs: list[str | dict[str, Any]] = []
    sources: dict[str, str] = {}
    for n in names:
        entry = local.task_index.get(n)
        if entry is not None and entry.yaml_path is not None and entry.kind.name == "TASK":
            cfg = load_yaml(entry.yaml_path, resolve_func=True)
            specs.append(_local_paths(cfg, Path(entry.yaml_path).parent, n))
            sources[n] = str(entry.yaml_path)
        else:
            specs.append(n)
            sources[n] = "registry" if n not in local.all_tasks else "local group"
    return TaskSet(names, specs, tuple(folders), manager, sources)


def check_loadable(ts: TaskSet) -> None:
    """Build every task once (lm-eval reads its dataset here): a registry task whose dataset
    is not in the local cache, or a data file that does not parse, fails before any model loads."""
    for name, spec in zip(ts.names, ts.specs):
        try:
            ts.manager.load([spec])
        except EvalError:
            raise
        except Exception as e:  # noqa: BLE001 - datasets raises many types (offline, parsing)
            msg = " ".join(str(e).split())[:300]
            where = "its dataset is not in the local Hugging Face cache or cannot be read" \
                if ts.sources.get(name) == "registry" else "its data cannot be read"
            raise EvalError(f"task {name}: {where} ({type(e).__name__}: {msg})") from None
