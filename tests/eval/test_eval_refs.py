"""What a MODEL argument resolves to, and the local task resolution (no model is run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.eval import EvalError, parse_model, parse_models, resolve_tasks
from workbench.eval.taskset import TASKS_DIR, check_loadable

HF_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}


def _ckpt(folder: Path, packed: bool = False) -> Path:
    folder.mkdir(parents=True)
    cfg = dict(HF_CONFIG, **({"quantization_config": {"quant_method": "compressed-tensors"}}
                             if packed else {}))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _run(folder: Path, recipe: str, *, export: str | None, steps=(4, 8)) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"recipe": recipe, "init": "/x/init"}))
    result = {"step": steps[-1] if steps else 0}
    if export is not None:
        _ckpt(folder / "export", packed=export == "packed")
        result["export"] = str(folder / "export")
    (folder / "result.json").write_text(json.dumps(result))
    for s in steps:
        d = folder / "checkpoints" / f"step_{s:08d}"
        d.mkdir(parents=True)
        (d / "COMPLETE").write_text(json.dumps({"step": s, "config": {"recipe": recipe}}))
    return folder


def test_checkpoints_and_ptq(tmp_path):
    bf16 = _ckpt(tmp_path / "base model")
    packed = _ckpt(tmp_path / "shipped", packed=True)
    r = parse_model(str(bf16))
    assert (r.kind, r.role, r.engine, r.packed) == ("checkpoint", "bf16", "transformers", False)
    r = parse_model(str(packed))
    assert (r.kind, r.role, r.packed) == ("checkpoint", "qat", True)
    r = parse_model(f"ptq:mxfp4+mxfp8@{bf16}")
    assert (r.kind, r.role, r.engine, r.recipe) == ("ptq", "ptq", "workbench",
                                                    "mxfp4:rceil+mxfp8_e4m3:rceil")
    assert r.path == bf16.resolve()


def test_run_folders_pick_what_the_run_trained(tmp_path):
    r = parse_model(str(_run(tmp_path / "packed-run", "mxfp4", export="packed")))
    assert (r.kind, r.role, r.step) == ("run-export", "qat", 8)
    # a BF16 export of a quantized run is the masters without their quantization: the DCP
    r = parse_model(str(_run(tmp_path / "bf16-export-run", "mxfp4", export="bf16")))
    assert (r.kind, r.role, r.step, r.recipe) == ("run-dcp", "qat", 8, "mxfp4:rceil")
    assert "is BF16" in r.note
    r = parse_model(str(_run(tmp_path / "no-export", "nvfp4", export=None)))
    assert (r.kind, r.step, r.path.name) == ("run-dcp", 8, "step_00000008")
    # a BF16 run's BF16 export is its model
    r = parse_model(str(_run(tmp_path / "baseline", "bf16", export="bf16")))
    assert (r.kind, r.role) == ("run-export", "bf16")
    # a named DCP checkpoint, not the newest
    step4 = tmp_path / "no-export" / "checkpoints" / "step_00000004"
    r = parse_model(str(step4))
    assert (r.kind, r.step, r.label) == ("run-dcp", 4, "no-export@step4")


def test_a_run_without_config_json_is_read_from_its_checkpoints(tmp_path):
    # a run started through the Python API (the demo's) has no config.json
    run = _run(tmp_path / "api-run", "nvfp4", export="bf16")
    (run / "config.json").unlink()
    r = parse_model(str(run))
    assert (r.kind, r.recipe, r.step) == ("run-dcp", "nvfp4:torchao", 8)


def test_labels_are_unique(tmp_path):
    a = _ckpt(tmp_path / "a" / "export")
    b = _ckpt(tmp_path / "b" / "model")
    c = _ckpt(tmp_path / "c" / "a" / "export")
    labels = [r.label for r in parse_models([str(a), str(b), str(c), str(a)])]
    assert labels == ["a/export", "b/model", "a/export#2", "a/export#3"]


@pytest.mark.parametrize("text,match", [
    ("ptq:mxfp4", "ptq:RECIPE@PATH"),
    ("ptq:mxfp5@{ckpt}", "mxfp5"),
    ("ptq:bf16@{ckpt}", "quantizes nothing"),
    ("ptq:mxfp4@{tmp}/nowhere", "does not exist"),
    ("{tmp}/nowhere", "no such file"),
    ("{tmp}/file.txt", "not a folder"),
    ("{tmp}/empty", "not a checkpoint folder"),
    ("{tmp}/badjson", "not valid JSON"),
    ("{tmp}/run-without-anything", "nothing to evaluate"),
])
def test_models_the_workbench_cannot_read(tmp_path, text, match):
    ckpt = _ckpt(tmp_path / "ckpt")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{")
    _run(tmp_path / "run-without-anything", "mxfp4", export=None, steps=())
    with pytest.raises(EvalError, match=match):
        parse_model(text.format(ckpt=ckpt, tmp=tmp_path))


def test_run_export_outside_the_run_is_refused(tmp_path):
    run = _run(tmp_path / "run", "mxfp4", export=None)
    elsewhere = _ckpt(tmp_path / "elsewhere", packed=True)
    (run / "result.json").write_text(json.dumps({"step": 8, "export": str(elsewhere)}))
    with pytest.raises(EvalError, match="outside the run folder"):
        parse_model(str(run))


def test_local_task_data_are_read_from_the_yaml_folder(tmp_path):
    ts = resolve_tasks("wb_code_choice, wb_code_complete")
    assert ts.names == ("wb_code_choice", "wb_code_complete")
    files = [s["dataset_kwargs"]["data_files"]["test"] for s in ts.specs]
    assert files == [str(TASKS_DIR / "code_choice.jsonl"), str(TASKS_DIR / "code_complete.jsonl")]
    # a user's folder (path with a space), data next to its YAML, read from another cwd
    inc = tmp_path / "my tasks"
    inc.mkdir()
    (inc / "data").mkdir()
    (inc / "data" / "d.jsonl").write_text(json.dumps({"q": "a", "a": "b"}) + "\n")
    yaml = ("task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
            "data/d.jsonl\ntest_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\n"
            "doc_to_target: '{{a}}'\nmetric_list:\n  - metric: exact_match\n")
    (inc / "mine.yaml").write_text(yaml)
    ts = resolve_tasks(["mine"], include=[inc])
    assert ts.specs[0]["dataset_kwargs"]["data_files"]["test"] == str(inc / "data" / "d.jsonl")
    check_loadable(ts)
    (inc / "data" / "d.jsonl").unlink()
    with pytest.raises(EvalError, match=r"task mine: data file .*d\.jsonl does not exist"):
        resolve_tasks(["mine"], include=[inc])
    with pytest.raises(EvalError, match="not a folder"):
        resolve_tasks(["mine"], include=[tmp_path / "nowhere"])
    with pytest.raises(EvalError, match="--tasks is empty"):
        resolve_tasks(" , ")


@pytest.mark.slow  # indexes lm-eval's whole task registry (seconds)
def test_unknown_task_names_close_matches():
    with pytest.raises(EvalError, match="unknown task 'gsm8kk'.*close matches: gsm8k"):
        resolve_tasks("wb_code_choice,gsm8kk")


def test_models_that_saw_other_documents_are_refused():
    from workbench.eval.runner import _same_documents

    same = [{"label": "a", "docs_sha": {"t": "x", "u": "y"}},
            {"label": "b", "docs_sha": {"t": "x", "u": "y"}}]
    _same_documents(same)
    with pytest.raises(EvalError, match="task u: b saw other documents than a"):
        _same_documents([same[0], {"label": "b", "docs_sha": {"t": "x", "u": "z"}}])
