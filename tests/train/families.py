"""Helpers of the family trainer tests: tests/model/family_oracle.py (transformers-written
checkpoints of every family) loaded by path, and a QAT-prepared workbench model of each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from workbench.model import MoEForCausalLM, load_hf_state_dict
from workbench.qat import prepare


def family_oracle():
    """tests/model/family_oracle.py; loaded by path because tests/model on sys.path would shadow
    this folder's conftest."""
    name = "_family_oracle"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "model" / "family_oracle.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def trained_like(case: str, recipe: str | None, *, seed: int = 3):
    """(cfg, transformers model, our model with its weights, QAT-prepared for `recipe`)."""
    fo = family_oracle()
    cfg = fo.CASES[case]
    hf = fo.family_model(cfg, seed=seed)
    model = MoEForCausalLM(cfg, seed=0)
    load_hf_state_dict(model, hf.state_dict())
    if recipe is not None:
        prepare(model, recipe)
    return cfg, hf, model


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, MoEForCausalLM):
            return model.eval()(x).logits
        return model(input_ids=x).logits
