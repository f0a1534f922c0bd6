"""What `MODEL` means on `workbench eval`'s command line: parsed once, into a `ModelRef`.

A MODEL is one of
- a checkpoint folder (``config.json`` + safetensors): BF16, or packed (``quantization_config``:
  compressed-tensors, gpt-oss MXFP4, ...), loaded the way transformers loads it;
- ``ptq:RECIPE@PATH``: the checkpoint PATH fake-quantized with RECIPE (``workbench.recipe``
  grammar, e.g. ``mxfp4``, ``nvfp4:te``) by ``workbench.qat.prepare``: post-training quantization;
- a trainer run folder (``--out``): the model the run trained. A packed export of the run is that
  model as it ships; otherwise (no export, or a BF16 export of a quantized run, which holds the
  masters without their quantization) its newest complete DCP checkpoint with the run's fake
  quantization prepared. A BF16 run's export is its model;
- a DCP checkpoint folder of a run (``RUN/checkpoints/step_NNNNNNNN``): that checkpoint with the
  run's fake quantization.

Each model gets a role for the recovery table: ``ptq`` for ``ptq:``, ``qat`` for a quantized run
and for a packed checkpoint, ``bf16`` for a BF16 checkpoint or a BF16 run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workbench._io import JSONFileError, read_json
from workbench.eval.errors import EvalError
from workbench.recipe import RecipeError, parse_qat_recipe
from workbench.train.checkpointing import COMPLETE, list_complete
from workbench.train.resume_config import recorded_config

ROLES = ("bf16", "ptq", "qat")
KINDS = ("checkpoint", "ptq", "run-export", "run-dcp")
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_GENERIC = re.compile(r"^(export.*|init|model|checkpoint|hf|ckpt)$")
MAX_JSON_BYTES = 1 << 22  # config.json / result.json of a run: a few KiB


def _err(text: str, why: str) -> EvalError:
    return EvalError(f"MODEL {text!r}: {why}")


@dataclass(frozen=True)
class ModelRef:
    """One model to evaluate, resolved: what is loaded, how, and its place in the table."""

    text: str  # as given
    kind: str  # one of KINDS
    path: Path  # the folder loaded: a checkpoint folder, or a DCP step folder (run-dcp)
    role: str  # one of ROLES
    label: str  # the row's name in tables (unique within one evaluation)
    recipe: str | None = None  # fake quantization applied (ptq, run-dcp) or the run's recipe
    run: Path | None = None  # the run folder, for models that come from one
    step: int | None = None  # the training step of a run's weights, when known
    packed: bool = False  # stored quantized (config.json has a quantization_config)
    note: str = ""  # why this source was chosen (printed, and kept in eval.json)
    train_config: dict[str, Any] | None = None  # the run's recorded TrainConfig (run models)

    @property
    def engine(self) -> str:
        """Who runs the forward: transformers for checkpoint folders, the workbench's model (with
        workbench.qat fake quantization) for ptq and DCP checkpoints."""
        return "transformers" if self.kind in ("checkpoint", "run-export") else "workbench"

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "kind": self.kind, "path": str(self.path), "role": self.role,
                "label": self.label, "recipe": self.recipe,
                "run": None if self.run is None else str(self.run), "step": self.step,
                "packed": self.packed, "note": self.note, "engine": self.engine}


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path` (capped, non-blocking: `_io.read_json`); else an EvalError
    naming the file."""
    try:
        obj = read_json(path, cap=MAX_JSON_BYTES, what=what)
    except JSONFileError as e:
        raise EvalError(str(e)) from None
    if not isinstance(obj, dict):
        raise EvalError(f"{path}: {what} is not a JSON object")
    return obj


def _hf_config(folder: Path) -> dict[str, Any] | None:
    f = folder / "config.json"
    return read_json_object(f, "config.json") if f.is_file() else None


def _is_checkpoint(folder: Path) -> bool:
    cfg = _hf_config(folder)
    return cfg is not None and ("architectures" in cfg or "model_type" in cfg)


def _is_run(folder: Path) -> bool:
    return (folder / "checkpoints").is_dir() or (folder / "result.json").is_file()


def _label(folder: Path) -> str:
    return f"{folder.parent.name}/{folder.name}" if _GENERIC.match(folder.name) else folder.name


def _recipe_text(recipe: Any, profile: Any, where: str) -> str:
    try:
        return str(parse_qat_recipe(recipe if recipe is not None else "bf16", profile))
    except (RecipeError, TypeError) as e:
        raise EvalError(f"{where}: recipe {recipe!r}: {e}") from None


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
    except ValueError:
        return False
    return True


def _ptq(text: str) -> ModelRef:
    body = text[len("ptq:"):]
    recipe, at, where = body.partition("@")
    if not at or not where:
        raise _err(text, "ptq: needs the checkpoint to quantize: write ptq:RECIPE@PATH "
                         "(e.g. ptq:mxfp4@runs/demo/init)")
    try:
        qr = parse_qat_recipe(recipe)
    except RecipeError as e:
        raise _err(text, str(e)) from None
    if qr.is_bf16:
        raise _err(text, f"ptq:{recipe} quantizes nothing; evaluate {where} itself for BF16")
    path = Path(where).expanduser()
    if not path.exists():
        raise _err(text, f"{path} does not exist")
    if not _is_checkpoint(path):
        raise _err(text, f"{path} is not a checkpoint folder (no config.json with "
                         "'architectures'); ptq: quantizes a BF16 or packed checkpoint")
    path = path.resolve()
    return ModelRef(text, "ptq", path, "ptq", f"ptq:{qr}@{_label(path)}", recipe=str(qr),
                    packed="quantization_config" in (_hf_config(path) or {}),
                    note=f"{path} fake-quantized with {qr} (workbench.qat.prepare)")


def _run_config(run: Path, meta: dict | None) -> dict[str, Any]:
    """The run's TrainConfig as recorded: by the checkpoint's COMPLETE marker, else config.json."""
    if meta is not None:
        conf = recorded_config(meta, run)
        if conf:
            return conf
    f = run / "config.json"
    if not f.is_file():
        raise EvalError(f"{run}: a run folder without config.json (the trainer writes it at "
                        "start); cannot tell its recipe")
    return read_json_object(f, "the run's config.json")


def _run_dcp(text: str, run: Path, step_dir: Path, meta: dict, note: str) -> ModelRef:
    conf = _run_config(run, meta)
    recipe = _recipe_text(conf.get("recipe"), conf.get("profile"), f"{step_dir / COMPLETE}")
    step = int(_STEP_DIR.match(step_dir.name).group(1))
    role = "bf16" if recipe == "bf16" else "qat"
    label = run.name if note.startswith("newest") else f"{run.name}@step{step}"
    return ModelRef(text, "run-dcp", step_dir.resolve(), role, label, recipe=recipe,
                    run=run.resolve(), step=step, note=note, train_config=conf)


def _run(text: str, run: Path) -> ModelRef:
    found = list_complete(run)
    # config.json is written by the trainer's command line; a run started through the Python
    # API (the demo's) has only its checkpoints' record of the configuration.
    conf = _run_config(run, None if (run / "config.json").is_file() or not found
                       else found[-1].meta)
    recipe = _recipe_text(conf.get("recipe"), conf.get("profile"), str(run / "config.json"))
    result = read_json_object(run / "result.json", "result.json") if (run / "result.json").is_file() \
        else {}
    export = result.get("export")
    export = Path(export) if isinstance(export, str) and export else run / "export"
    if export.exists() and not _inside(export, run):
        raise EvalError(f"{run / 'result.json'}: its export {export} lies outside the run folder")
    step = result.get("step") if isinstance(result.get("step"), int) else None
    why_not_export = "the run has no export"
    if export.is_dir() and _is_checkpoint(export):
        packed = "quantization_config" in (_hf_config(export) or {})
        if recipe == "bf16" or packed:
            role = "bf16" if recipe == "bf16" else "qat"
            what = "packed" if packed else "BF16"
            return ModelRef(text, "run-export", export.resolve(), role, run.name, recipe=recipe,
                            run=run.resolve(), step=step, packed=packed,
                            note=f"the run's {what} export", train_config=conf)
        why_not_export = (f"its export {export.name}/ is BF16 (the masters without their "
                          f"{recipe} quantization)")
    if not found:
        raise EvalError(f"{run}: nothing to evaluate: {why_not_export} and no complete DCP "
                        "checkpoint under checkpoints/")
    newest = found[-1]
    return _run_dcp(text, run, newest.path, newest.meta,
                    f"newest DCP checkpoint (step {newest.step}) with the run's {recipe} fake "
                    f"quantization; {why_not_export}")


def parse_model(text: str) -> ModelRef:
    """Resolve one MODEL argument (see the module docstring); EvalError says what is wrong."""
    if not isinstance(text, str) or not text:
        raise EvalError(f"MODEL must be a non-empty string, got {text!r}")
    if text.startswith("ptq:"):
        return _ptq(text)
    path = Path(text).expanduser()
    if not path.exists():
        raise _err(text, "no such file or folder")
    if not path.is_dir():
        raise _err(text, "not a folder (a checkpoint folder, a run folder or ptq:RECIPE@PATH)")
    m = _STEP_DIR.match(path.name)
    if m and (path / COMPLETE).is_file() and path.parent.name == "checkpoints":
        run = path.parent.parent
        meta = read_json_object(path / COMPLETE, "the checkpoint's COMPLETE marker")
        return _run_dcp(text, run, path, meta, f"DCP checkpoint step {int(m.group(1))} with "
                                               "the run's fake quantization")
    if _is_run(path):
        return _run(text, path)
    if _is_checkpoint(path):
        path = path.resolve()
        packed = "quantization_config" in (_hf_config(path) or {})
        return ModelRef(text, "checkpoint", path, "qat" if packed else "bf16", _label(path),
                        packed=packed, note="packed checkpoint" if packed else "BF16 checkpoint")
    raise _err(text, "not a checkpoint folder (config.json with 'architectures'), a run folder "
                     "(checkpoints/ or result.json) or a DCP checkpoint (checkpoints/step_N)")


def parse_models(items: list[str | ModelRef]) -> list[ModelRef]:
    """Every MODEL (strings are parsed, ModelRefs kept), with labels made unique (a repeated
    folder name gets #2, #3...)."""
    if not items:
        raise EvalError("no MODEL given")
    refs = [t if isinstance(t, ModelRef) else parse_model(t) for t in items]
    seen: dict[str, int] = {}
    out = []
    for r in refs:
        n = seen.get(r.label, 0) + 1
        seen[r.label] = n
        out.append(r if n == 1 else replace(r, label=f"{r.label}#{n}"))
    return out

