"""Distillation from the frozen BF16 --init model: the KL term, its logging, and full runs on a
transformers-written checkpoint with its own tokenizer and JSONL data at EP1/EP2/EP4, SIGKILL +
--resume, and the export loaded back by transformers with the tokenizer next to it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import metrics, run
from realdata import corpus_texts, model_with_tokenizer, write_jsonl
from test_resume import _kill_after

from workbench.train.cli import main
from workbench.train.distill import kl_per_token


def test_kl_per_token_is_kl_teacher_to_student():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    for T in (1.0, 2.0):
        p = torch.softmax(t.double() / T, -1)
        q = torch.softmax(s.double() / T, -1)
        want = (p * (p.log() - q.log())).sum(-1).mean()  # per token, teacher || student
        torch.testing.assert_close(kl_per_token(s, t, T).double(), want, rtol=1e-5, atol=1e-7)
    assert kl_per_token(t, t) == 0
    assert kl_per_token(s, t) != kl_per_token(t, s)  # direction matters


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    texts = corpus_texts(240, 500)
    model = model_with_tokenizer(root / "model", texts)
    return {"root": root, "model": model,
            "train": write_jsonl(root / "train.jsonl", texts[:200], chat_every=4),
            "val": write_jsonl(root / "val.jsonl", texts[200:])}


def _args(real, out, recipe, steps, *extra):
    return ["--init", str(real["model"]), "--data", str(real["train"]), "--val-data",
            str(real["val"]), "--recipe", recipe, "--distill", "--steps", str(steps),
            "--batch", "4", "--seq", "32", "--lr", "1e-3", "--val-every", "3",
            "--wandb", "disabled", "--out", str(out), *extra]


def test_bf16_distill_first_step_kl_is_zero_and_val_metrics_logged(tmp_path, real):
    main(_args(real, tmp_path / "bf16", "bf16", 3, "--ckpt-every", "0"))
    rows = metrics(tmp_path / "bf16")
    # Student == teacher before the first update: the same weights, the same fp32 CPU math.
    assert abs(rows[0]["kl"]) < 1e-7
    assert rows[1]["kl"] > 1e-6  # after an update the student has moved away from the teacher
    v = rows[2]
    assert {"val_loss", "val_kl", "val_top1_agree", "teacher_val_loss"} <= set(v)
    assert 0 < v["val_top1_agree"] <= 1 and v["val_kl"] > 0
    assert all("kl" in r for r in rows)
    main(_args(real, tmp_path / "q", "mxfp4", 1, "--ckpt-every", "0", "--val-every", "1"))
    q = metrics(tmp_path / "q")[0]
    assert q["kl"] > 1e-6  # fake-quantized experts: the student differs from step 1
    # The teacher is the untouched --init model: its val loss does not depend on the student.
    assert q["teacher_val_loss"] == v["teacher_val_loss"]


@pytest.mark.distributed
def test_ep1_ep2_ep4_same_curve_resume_bitwise_and_export(tmp_path, real):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = 6
    curves = {}
    for nproc in (1, 2, 4):
        out = tmp_path / f"ep{nproc}"
        extra = ["--ckpt-every", "0"] + (["--export", "compressed-tensors"] if nproc == 2 else [])
        run(nproc, _args(real, out, "mxfp4", steps, *extra), timeout=600)
        curves[nproc] = metrics(out)
    data = [json.loads((tmp_path / f"ep{n}" / "data.json").read_text()) for n in (1, 2, 4)]
    assert data[0] == data[1] == data[2]  # one tokenization, one cache, whatever the EP size
    for n in (2, 4):
        for a, b in zip(curves[1], curves[n]):
            for k in ("loss", "kl", "val_loss", "val_kl", "teacher_val_loss"):
                if k in a:
                    assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (n, k, a["step"])

    # SIGKILL at step 4 (checkpoint at 2 and 4 may be partial), then --resume: bitwise.
    out = tmp_path / "killed"
    args = _args(real, out, "mxfp4", steps, "--ckpt-every", "2")
    _kill_after(2, args, out, 4)
    run(2, [*args, "--resume"], timeout=600)
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    for a, b in zip(curves[2], resumed):
        for k in ("loss", "kl", "grad_norm", "lr", "aux_loss", "val_loss", "val_kl"):
            assert a.get(k) == b.get(k), (k, a["step"])

    export = tmp_path / "ep2" / "export"
    tok = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    ref_tok = AutoTokenizer.from_pretrained(str(real["model"]), local_files_only=True)
    text = real["val"].read_text()[:300]
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.vocab_size == 512
    ids = torch.tensor([tok(text)["input_ids"][:32]])
    with torch.no_grad():
        assert torch.isfinite(hf(input_ids=ids).logits).all()


@pytest.mark.distributed
def test_fsdp_shards_the_teacher_and_keeps_the_one_process_curve(tmp_path, real):
    """EP1 x FSDP2 at world 2: the teacher is sharded like the student (each rank holds half of
    its weights: on CPU both are fp32, so exactly the student's masters' bytes), and the run
    gives the one-process run's losses within the FSDP tests' 1e-5 (test_fsdp.py)."""
    steps = 3
    ref_out, out = tmp_path / "one", tmp_path / "fsdp"
    run(1, _args(real, ref_out, "mxfp4", steps, "--ckpt-every", "0"), timeout=600)
    run(2, _args(real, out, "mxfp4", steps, "--ckpt-every", "0", "--ep", "1", "--fsdp"),
        timeout=600)
    ref, got = metrics(ref_out), metrics(out)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, steps + 1))
    for a, b in zip(ref, got):
        for k in ("loss", "kl", "grad_norm", "aux_loss", "val_loss", "val_kl", "val_top1_agree",
                  "teacher_val_loss"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (k, a["step"])
    assert "val_kl" in got[-1]
    assert ref[0]["mem_teacher_bytes"] == ref[0]["mem_masters_bytes"]  # replicated, one process
    assert got[0]["mem_teacher_bytes"] == got[0]["mem_masters_bytes"]  # sharded like the student
    assert got[0]["mem_teacher_bytes"] < 0.6 * ref[0]["mem_teacher_bytes"]

