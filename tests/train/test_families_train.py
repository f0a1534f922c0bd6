"""`--init` of every family from a checkpoint transformers wrote (gpt-oss also from its released
MXFP4 layout) trains QAT on JSONL text: EP2 gives the EP1 losses, a SIGKILLed run resumes bit
for bit, and the export (the format each family ships in) loads in transformers with the logits
of `from_pretrained` of the export. Tolerances: EP runs agree to fp32 summation order (the
tolerance of test_train_e2e.py's EP tests); exports as test_export_families.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import metrics, run
from families import family_oracle, logits
from realdata import corpus_texts, train_tokenizer, write_jsonl
from test_resume import _kill_after

pytest.importorskip("transformers", reason="transformers writes and loads the checkpoints")

from workbench.model import from_pretrained
from workbench.train.checkpointing import list_complete

VOCAB = 512  # the trained tokenizer's 400 tokens fit
FAMILIES = ("gpt_oss_mxfp4", "gpt_oss", "deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module")
def inits(tmp_path_factory):
    """family -> checkpoint folder (with a tokenizer), plus the JSONL corpus."""
    fo = family_oracle()
    root = tmp_path_factory.mktemp("families")
    texts = corpus_texts(240, 500)
    out = {"data": write_jsonl(root / "train.jsonl", texts[:200])}
    for name in FAMILIES:
        cfg = fo.CASES[name.removesuffix("_mxfp4")].replace(vocab_size=VOCAB)
        folder = root / name
        if name == "gpt_oss_mxfp4":
            fo.write_gpt_oss_mxfp4(cfg, folder, seed=1)
        else:
            fo.write(cfg, folder, seed=1, dtype=torch.bfloat16)
        train_tokenizer(folder, texts)
        out[name] = folder
    return out


def _args(inits, family, recipe, out, steps=3, *extra):
    return ["--init", str(inits[family]), "--data", str(inits["data"]), "--recipe", recipe,
            "--steps", str(steps), "--batch", "4", "--seq", "32", "--lr", "1e-3", "--warmup", "2",
            "--wandb", "disabled", "--val-every", "0", "--out", str(out), *extra]


def _same_losses(ref: list[dict], ep: list[dict]) -> None:
    assert [r["step"] for r in ep] == [r["step"] for r in ref]
    for a, b in zip(ref, ep):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


EXPORT = {"gpt_oss_mxfp4": "gpt-oss", "gpt_oss": "bf16", "deepseek_v3": "compressed-tensors",
          "glm4_moe": "compressed-tensors"}


@pytest.mark.distributed
@pytest.mark.parametrize("family, recipe", [
    ("gpt_oss_mxfp4", "mxfp4"), ("deepseek_v3", "mxfp4"), ("glm4_moe", "nvfp4"),
    pytest.param("gpt_oss", "nvfp4", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "nvfp4", marks=pytest.mark.slow),
    pytest.param("glm4_moe", "mxfp4", marks=pytest.mark.slow),
    pytest.param("gpt_oss_mxfp4", "nvfp4", marks=pytest.mark.slow),
])
def test_ep2_trains_like_ep1_and_exports_what_transformers_loads(tmp_path, inits, family,
                                                                  recipe):
    # the family's own format for MXFP4; BF16 for NVFP4 (transformers 5.24 mis-scales fused
    # NVFP4 experts: test_export_families.py checks those against compressed-tensors instead)
    export = EXPORT[family] if recipe == "mxfp4" else "bf16"
    ep1, ep2 = tmp_path / "ep1", tmp_path / "ep2"
    run(1, _args(inits, family, recipe, ep1, 3, "--ckpt-every", "0"))
    run(2, _args(inits, family, recipe, ep2, 3, "--ckpt-every", "0", "--export", export))
    _same_losses(metrics(ep1), metrics(ep2))
    assert metrics(ep1)[-1]["loss"] < 7.0  # trains from the checkpoint, not from noise

    path = ep2 / "export"
    cfg = from_pretrained(path).config
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _transformers(path, export)
    torch.testing.assert_close(logits(from_pretrained(path), x), logits(ref, x),
                               rtol=2e-5, atol=2e-5)
    assert cfg.family == family.removesuffix("_mxfp4")


def _transformers(path, export):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    kw = {"quantization_config": Mxfp4Config(dequantize=True)} if export == "gpt-oss" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()
    for p in model.parameters():  # a compressed-tensors model refuses .float(): cast the data
        p.data = p.data.float()
    for b in model.buffers():
        if b.is_floating_point():
            b.data = b.data.float()
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("family", ["gpt_oss_mxfp4", "deepseek_v3",
                                    pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_sigkill_then_resume_is_bit_exact(tmp_path, inits, family):
    steps = 8
    ref, out = tmp_path / "ref", tmp_path / "run"
    run(1, _args(inits, family, "mxfp4", ref, steps, "--ckpt-every", "0"))
    args = _args(inits, family, "mxfp4", out, steps, "--ckpt-every", "2", "--keep", "3")
    _kill_after(1, args, out, step=5)
    assert not (out / "result.json").exists(), "the run finished before the kill"
    assert list_complete(out)[-1].step in (4, 6)
    run(1, [*args, "--resume"])
    want, got = metrics(ref), metrics(out)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(want, got):
        assert (a["step"], a["loss"], a["grad_norm"], a["lr"], a["aux_loss"]) == \
            (b["step"], b["loss"], b["grad_norm"], b["lr"], b["aux_loss"])


def test_correction_bias_stays_frozen_by_default(tmp_path, inits):
    from safetensors import safe_open

    out = tmp_path / "run"
    run(1, _args(inits, "deepseek_v3", "mxfp4", out, 2, "--ckpt-every", "0", "--export",
                 "compressed-tensors"))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    index = json.loads((out / "export" / "model.safetensors.index.json").read_text())
    with safe_open(out / "export" / index["weight_map"][name], "pt") as f:
        after = f.get_tensor(name)
    with safe_open(inits["deepseek_v3"] / "model.safetensors", "pt") as f:
        before = f.get_tensor(name)
    assert after.dtype == torch.float32 and before.abs().max() > 0
    assert torch.equal(after, before.float())


def _bias(path, layer: int = 1) -> torch.Tensor:
    from safetensors import safe_open

    name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    with safe_open(path / index["weight_map"][name], "pt") as f:
        return f.get_tensor(name)


@pytest.mark.distributed
def test_router_bias_update_is_the_same_at_ep2_and_resumes_bit_exact(tmp_path, inits):
    """--router-bias-update: EP2 counts the global batch's loads (an all-reduce) and moves every
    replica's bias as EP1 does; a SIGKILLed run resumes with the bias it had checkpointed."""
    from safetensors import safe_open

    steps, rate = 6, 0.01
    flags = ("--router-bias-update", str(rate), "--export", "compressed-tensors")
    ep1, ep2, killed = tmp_path / "ep1", tmp_path / "ep2", tmp_path / "killed"
    run(1, _args(inits, "deepseek_v3", "mxfp4", ep1, steps, "--ckpt-every", "0", *flags))
    run(2, _args(inits, "deepseek_v3", "mxfp4", ep2, steps, "--ckpt-every", "0", *flags))
    _same_losses(metrics(ep1), metrics(ep2))
    b1, b2 = _bias(ep1 / "export"), _bias(ep2 / "export")
    with safe_open(inits["deepseek_v3"] / "model.safetensors", "pt") as f:
        b0 = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").float()
    moved = (b1 - b0) / rate  # whole steps of +-rate per expert, at most one per step
    assert moved.abs().max() > 0 and (moved - moved.round()).abs().max() < 1e-3
    assert moved.abs().max() <= steps + 1e-3
    torch.testing.assert_close(b2, b1, rtol=0, atol=1e-6)

    args = _args(inits, "deepseek_v3", "mxfp4", killed, steps, "--ckpt-every", "2", "--keep", "3",
                 *flags)
    _kill_after(1, args, killed, step=4)
    run(1, [*args, "--resume"])
    for a, b in zip(metrics(ep1), metrics(killed)):
        assert (a["step"], a["loss"], a["grad_norm"]) == (b["step"], b["loss"], b["grad_norm"])
    assert torch.equal(_bias(killed / "export"), b1)


def test_router_bias_update_on_a_softmax_family_is_one_line_error(tmp_path, inits):
    import subprocess

    from conftest import REPO, command, env

    args = _args(inits, "gpt_oss", "mxfp4", tmp_path / "run", 2, "--router-bias-update", "0.01")
    p = subprocess.run(command(1, args), env=env(), cwd=REPO, capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert "--router-bias-update" in line and "gpt_oss" in line and "topk_softmax" in line
    assert "Traceback" not in p.stderr


def test_distill_telemetry_checkpointing_and_compare_on_gpt_oss(tmp_path, inits):
    """The rest of the trainer on a gpt-oss --init from its MXFP4 layout: distillation from the
    frozen --init model, per-expert telemetry, full activation checkpointing, the native export,
    and `workbench compare` of that export against PTQ of the BF16 model, expert by expert."""
    import pandas as pd

    from workbench.cli import main as workbench

    out = tmp_path / "run"
    run(1, _args(inits, "gpt_oss_mxfp4", "mxfp4", out, 2, "--ckpt-every", "0", "--distill",
                 "--expert-stats-every", "1", "--activation-checkpointing", "full",
                 "--export", "gpt-oss"))
    rows = metrics(out)
    assert all(r["kl"] > 0 for r in rows[1:]) and abs(rows[0]["kl"]) < 1e-3
    stats = pd.read_parquet(out / "expert_stats.parquet")
    cfg = family_oracle().CASES["gpt_oss"]
    assert set(stats["layer"]) == set(range(cfg.num_layers))
    assert set(stats["expert"]) == set(range(cfg.num_experts))
    step1 = stats[stats["step"] == 1]
    # every token (4 sequences of seq + 1) went to top_k experts in every layer, counted once
    # although activation checkpointing runs each router twice
    per_layer = step1.groupby(["layer", "expert"])["load"].first().groupby("layer").sum()
    assert (per_layer == 4 * 33 * cfg.top_k).all(), per_layer
    assert workbench(["compare", str(out / "export"), "ptq:mxfp4", "--reference",
                      str(inits["gpt_oss"]), "--out", str(tmp_path / "cmp"),
                      "--device", "cpu"]) == 0
    table = pd.read_csv(tmp_path / "cmp" / "compare.csv")
    assert len(table) == cfg.num_layers * cfg.num_experts * 3
    assert table["a_rel_err"].between(0.01, 0.5).all()  # MXFP4 weights, not BF16 copies
