"""FSDP2 on one GPU: the GPU preset trained with FSDP2 at world 1 and full activation
checkpointing, measured peak memory against `workbench.train.plan`.

    python3 jobs/gpu/fsdp_world1.py                 # qwen3_30b_a3b_like, 10 steps (device tool)
    python3 jobs/gpu/fsdp_world1.py --cpu           # dry run: tiny preset on CPU, 3 steps
    python3 jobs/gpu/fsdp_world1.py --recipe bf16 --batch 4 --seq 2048

It runs the trainer's own `workbench.train.cli.main` (so `--fsdp` makes the one-rank process group
and FSDP2 shards over it: fp32 masters and AdamW state, BF16 gathered compute copies one layer at a
time), then prints, per rank: the trainer's logged `peak_mem_gib` (CUDA allocator peak, max over
steps), its measured `mem_*_bytes` of step 1, and the plan's rows at the same layout, batch,
sequence length and checkpointing. The final checkpoint is skipped: at 4 layers the state is
~36 GB, which would take minutes to write on the lease's 64 GiB disk and measures nothing here.
Writes OUT/fsdp_world1.json (OUT: $OUT or /tmp/out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run: tiny preset on CPU")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--recipe", default="mxfp4")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--act-ckpt", default="full")
    a = ap.parse_args()
    preset = a.preset or ("tiny" if a.cpu else "qwen3_30b_a3b_like")
    steps = a.steps or (3 if a.cpu else 10)
    batch, seq = (4, 32) if a.cpu else (a.batch, a.seq)

    import torch

    from workbench.model import preset as model_preset
    from workbench.train import cli, loop
    from workbench.train.plan import plan

    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu for the dry run")
    # The measurement does not need the ~36 GB final checkpoint (see the module doc).
    skipped = []
    # loop.ckpt is workbench.train.checkpointing; save(out, model, opt, sched, step, ...)
    loop.ckpt.save = lambda *args, **kw: skipped.append(args[4])
    out = Path(tempfile.mkdtemp(prefix="fsdp_world1-"))
    argv = ["--preset", preset, "--recipe", a.recipe, "--steps", str(steps), "--out", str(out),
            "--batch", str(batch), "--seq", str(seq), "--warmup", "2", "--val-every", "0",
            "--ckpt-every", "0", "--wandb", "disabled", "--fsdp",
            "--activation-checkpointing", a.act_ckpt]
    print("[fsdp_world1] trainer argv:", " ".join(argv), flush=True)
    result = cli.main(argv)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mcfg = model_preset(preset)
    mcfg = mcfg.replace(max_seq_len=max(seq, mcfg.max_seq_len))
    p = plan(mcfg, 1, 1, 141.0, batch=batch, seq=seq, act_ckpt=a.act_ckpt,
             device="cpu" if a.cpu else "cuda", qat=a.recipe != "bf16", fsdp_on=True)
    m, first = p.memory, recs[0]
    peak = max(r["peak_mem_gib"] for r in recs)
    rows = [("masters", m.masters, first.get("mem_masters_bytes")),
            ("gradients", m.grads, first.get("mem_grads_bytes")),
            ("optimizer", m.optimizer, first.get("mem_optimizer_bytes")),
            ("activations (saved for backward)", m.saved, first.get("mem_activations_bytes")),
            ("bf16 compute copies", m.params_compute, None),
            ("QAT fake-quantized copies", m.qat_copies, None),
            ("FSDP2 buffers", m.fsdp_buffers, None),
            ("total (peak)", m.total, peak * GIB)]
    print(p, flush=True)
    print(f"\n{'per rank':<36} {'plan GiB':>10} {'measured GiB':>13}")
    for name, want, got in rows:
        g = f"{got / GIB:>13.3f}" if got is not None else f"{'-':>13}"
        print(f"{name:<36} {want / GIB:>10.3f} {g}")
    print(f"\nlosses: {[round(r['loss'], 4) for r in recs]}")
    print(f"tokens/s (last step): {recs[-1]['tokens_per_s']:.0f}; checkpoints skipped at steps "
          f"{skipped}")
    dest = Path(os.environ.get("OUT", "/tmp/out"))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "fsdp_world1.json").write_text(json.dumps({
        "argv": argv, "result": result, "metrics": recs, "plan": m.as_dict(),
        "plan_text": str(p), "peak_mem_gib": peak,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"},
        indent=1))


if __name__ == "__main__":
    main()
