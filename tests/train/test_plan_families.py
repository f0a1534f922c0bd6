"""`workbench plan` on the released config.json of DeepSeek-V3 and gpt-oss: the published
parameter counts, MLA counted as MLA, the multi-token-prediction layer left out, and the
planner's count equal to the model built on the meta device for every family preset.

Published totals: DeepSeek-V3 technical report (arXiv 2412.19437): 671B parameters, the
multi-token-prediction module's 14B not included (the model card: 685B in all); gpt-oss model
card (arXiv 2508.10925, table 1): gpt-oss-120b 116.83B, gpt-oss-20b 20.91B.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers parses config.json (pip install 'workbench[data]')")

from workbench.arch import PRESETS, preset
from workbench.cli import main
from workbench.model import MoEForCausalLM
from workbench.train.memory import param_counts


def _released():
    name = "_released_configs"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "model" / "released_configs.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.mark.parametrize("model, printed", [
    ("DEEPSEEK_V3", "model: 671.03B parameters"),
    ("GPT_OSS_120B", "model: 116.83B parameters"),
    ("GPT_OSS_20B", "model: 20.91B parameters"),
])
def test_plan_prints_the_published_counts(tmp_path, capsys, model, printed):
    (tmp_path / "config.json").write_text(json.dumps(getattr(_released(), model)))
    code = main(["plan", str(tmp_path), "--gpus", "16", "--batch", "64", "--seq", "4096",
                 "--activation-checkpointing", "full"])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    assert printed in out, out
    if model == "DEEPSEEK_V3":
        assert "MLA attention" in out and "1 multi-token-prediction layer(s) are not part" in out
    else:
        assert "GQA attention" in out and "clamped_swiglu" in out


def test_plan_layers_override_keeps_the_layer_pattern(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_released().GPT_OSS_20B))
    assert main(["plan", str(tmp_path), "--gpus", "1", "--batch", "1", "--seq", "512",
                 "--layers", "3"]) in (0, 1)
    assert "32 experts x 3 MoE layers" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_planner_counts_equal_the_built_model(name):
    cfg = preset(name)
    model = MoEForCausalLM(cfg, device="meta")
    assert param_counts(cfg).total(cfg.num_experts) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model", ["DEEPSEEK_V3", "KIMI_K2", "GLM_45", "GPT_OSS_120B"])
def test_planner_counts_equal_the_built_model_of_released_configs(model):
    from workbench.arch import config_from_dict

    cfg = config_from_dict(getattr(_released(), model))
    with torch.device("meta"):
        built = MoEForCausalLM(cfg, device="meta")
    assert param_counts(cfg).total(cfg.num_experts) == sum(p.numel() for p in built.parameters())
