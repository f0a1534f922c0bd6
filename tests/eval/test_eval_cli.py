"""Input the user can fix is one `error: ...` line and exit code 2, never a traceback."""

from __future__ import annotations

import json

import pytest
from builders import workbench_eval

from workbench.eval.cli import main

TASKS = "wb_code_choice,wb_code_complete"


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


def _bare_ckpt(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}))
    return folder


@pytest.mark.parametrize("case,match", [
    ("no config", "not a checkpoint folder"),
    ("missing", "no such file or folder"),
    ("bad ptq recipe", "mxfp9"),
    ("no weights", "transformers cannot load this checkpoint"),
    ("ptq of no weights", r"no model\.safetensors\.index\.json, model\.safetensors"),
    ("limit", "--limit must be a positive count"),
    ("missing data file", r"task broken: data file .*gone\.jsonl does not exist"),
])
def test_one_error_line_and_exit_2(tmp_path, capsys, case, match):
    (tmp_path / "empty").mkdir()
    bare = _bare_ckpt(tmp_path / "bare")
    inc = tmp_path / "tasks"
    inc.mkdir()
    (inc / "broken.yaml").write_text(
        "task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: gone.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\n"
        "doc_to_target: '{{a}}'\n")
    argv = {
        "no config": [tmp_path / "empty", "--tasks", TASKS],
        "missing": [tmp_path / "nowhere", "--tasks", TASKS],
        "bad ptq recipe": [f"ptq:mxfp9@{bare}", "--tasks", TASKS],
        "no weights": [bare, "--tasks", TASKS],
        "ptq of no weights": [f"ptq:mxfp4@{bare}", "--tasks", TASKS],
        "limit": [bare, "--tasks", TASKS, "--limit", "-3"],
        "missing data file": [bare, "--tasks", "broken", "--include", inc],
    }[case]
    code = main([*map(str, argv), "--out", str(tmp_path / "out"), "--device", "cpu"])
    errors = _errors(capsys)
    assert code == 2 and len(errors) == 1, errors
    assert __import__("re").search(match, errors[0]), errors[0]
    assert not (tmp_path / "out" / "eval.json").exists()


@pytest.mark.slow  # a new process imports lm-eval and indexes its whole task registry
def test_unknown_task_from_the_command_line(tmp_path):
    bare = _bare_ckpt(tmp_path / "bare")
    proc = workbench_eval([bare, "--tasks", "wb_code_choice,hellaswagg", "--out",
                           tmp_path / "out"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "unknown task 'hellaswagg'" in errors[0]
    assert "close matches: hellaswag" in errors[0]


@pytest.mark.slow  # lm-eval's registry index and a generation task
def test_registry_task_runs_offline_from_the_local_cache(group, tmp_path):
    """gsm8k from lm-eval's registry, its dataset only in the local datasets cache: evaluated
    offline; the same task without the cache is one error line naming it."""
    from builders import cache_hub_dataset

    from workbench.track import read_eval

    args = [group["bf16_model"], "--tasks", "gsm8k", "--limit", "2", "--num-fewshot", "1",
            "--out", tmp_path / "out"]
    proc = workbench_eval(args, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: task gsm8k: its dataset is not in "
                                                     "the local Hugging Face cache"), errors
    cache_hub_dataset(tmp_path, "openai/gsm8k", "main")
    proc = workbench_eval(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (m,) = read_eval(tmp_path / "out")["models"]
    assert set(m["results"]["gsm8k"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert m["n_samples"]["gsm8k"] == 2


def test_workbench_eval_help_reaches_the_eval_parser(capsys):
    from workbench.cli import main as workbench_main

    with pytest.raises(SystemExit) as exit_:
        workbench_main(["eval", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: workbench eval") and "--tasks" in out and "ptq:RECIPE@PATH" in out
