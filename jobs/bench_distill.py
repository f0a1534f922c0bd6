"""Cost of --distill: step time of QAT with the frozen BF16 teacher vs the same QAT without it,
in one run, on one GPU (goal: ratio <= 1.4, the teacher costs one forward pass).

    python jobs/bench_distill.py [--preset qwen3_30b_a3b_like] [--recipe mxfp4] [--steps 12]
                                 [--batch 8] [--seq 1024]

A model of the preset is written once as a BF16 HF checkpoint (the --init of both runs); the
plain and the distilled run are built from it by the trainer's own code (`build`,
`distill.build_teacher`) and stepped alternately with `train_step` on the same global batches
(the shipped corpus), so a shared machine slows both alike. Medians over the steps after the
first two (compile/allocator warm-up). Prints a table; writes it as JSON to $OUT/bench_distill.json
when OUT is set. Runs on CPU too (slowly; for a dry run use --preset tiny --seq 64).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_init(preset: str, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from workbench.model import MoEForCausalLM, to_hf_state_dict
    from workbench.model import preset as model_preset

    cfg = model_preset(preset)
    model = MoEForCausalLM(cfg, seed=0, dtype=torch.bfloat16)
    sd = {k: v.contiguous() for k, v in to_hf_state_dict(model, layout="per_expert").items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    cfg_json = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "moe_intermediate_size": cfg.expert_ffn, "intermediate_size": cfg.dense_ffn,
                "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
                "norm_topk_prob": cfg.norm_topk_prob, "rms_norm_eps": cfg.rms_eps,
                "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
                "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(cfg_json))
    del model, sd


def bench(a, init: Path) -> list[dict]:
    import torch

    from workbench.train import distill, distributed
    from workbench.train.args import config_from_args
    from workbench.train.build import build
    from workbench.train.data import load_corpus
    from workbench.train.loop import train_step

    info = distributed.setup()
    tokens = load_corpus().train
    runs = {}
    for name, extra in (("plain", []), ("distill", ["--distill"])):
        # No --preset: the model is the checkpoint's own (the path a real model takes).
        cfg = config_from_args(["--init", str(init), "--recipe", a.recipe, "--steps",
                                str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
                                "--out", "unused", "--lr", "1e-5", *extra])
        b = build(cfg, info)
        teacher = distill.build_teacher(cfg, info, b.layout) if cfg.distill else None
        runs[name] = (cfg, b, teacher, [])
    for step in range(1, a.steps + 1):
        for cfg, b, teacher, recs in runs.values():
            recs.append(train_step(b.model, b.opt, b.sched, tokens, cfg, info, step,
                                   teacher=teacher))
    peak = (torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
            else float("nan"))
    rows = []
    for name, (_, _, _, recs) in runs.items():
        m = recs[2:]
        rows.append({"run": name, "step_time_s": statistics.median(r["step_time_s"] for r in m),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in m),
                     "final_loss": m[-1]["loss"], "final_kl": m[-1].get("kl", float("nan"))})
    for r in rows:
        r["vs_plain"] = r["step_time_s"] / rows[0]["step_time_s"]
    rows[-1]["peak_mem_gib_both"] = peak
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_30b_a3b_like")
    p.add_argument("--recipe", default="mxfp4")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    a = p.parse_args()
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"# machine: {platform.machine()} {os.cpu_count()} cpus, gpu {gpu}, torch "
          f"{torch.__version__}")
    print(f"# preset {a.preset} (as a BF16 checkpoint, --init), recipe {a.recipe}, global batch "
          f"{a.batch} x {a.seq}, {a.steps} steps alternated, median of steps 3..{a.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        write_init(a.preset, Path(tmp))
        rows = bench(a, Path(tmp))
    cols = ["run", "step_time_s", "tokens_per_s", "vs_plain", "final_loss", "final_kl"]
    widths = [max(len(c), 12) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join((f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c])).rjust(w)
                        for c, w in zip(cols, widths)))
    ratio = rows[1]["vs_plain"]
    print(f"# distill / plain step time: {ratio:.3f}x (goal <= 1.4x: "
          f"{'met' if ratio <= 1.4 else 'NOT met'})")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_distill.json").write_text(json.dumps(
            {"args": vars(a), "gpu": gpu, "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
