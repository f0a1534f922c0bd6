"""Trainer step at the shape of a real QAT run: seq 4096, as many tokens as memory allows.

    python jobs/bench_step_gpu.py                            # qwen3_30b_a3b_like, 4 layers, seq 4096
    python jobs/bench_step_gpu.py --preset tiny --seq 64 --batch 2 --layers 0 --rounds 2 --cpu   # dry run

One process, one model: the trainer's own `build` (activation checkpointing, fp32 masters,
the trainer's AdamW) and `train_step`. Every configuration (a recipe and its levers, below)
runs `--steps` steps per round, configurations interleaved round after
round, so drift over the run hits all of them alike; the table reports medians of the rounds
after the first. QAT recipes are `prepare`d onto the same masters and `unprepare`d after their
steps; the optimizer state carries over (it changes what is trained, not the work a step does).

Columns: wall ms/step (host clock, the step ends in its own host synchronisation), GPU busy
ms/step (sum of kernel times over `--profile` profiled steps: the time the GPU worked, so wall -
busy is time it waited for the host), tokens/s/GPU, TFLOP/s, MFU, peak GiB.

FLOPs (the formula the table uses, per trained token, forward + backward = 3x forward):
    6 * N_active + 6 * L * H * Dh * (S + 1)
N_active counts every matrix a token is multiplied by (attention projections, router, dense and
shared FFNs, LM head; routed experts as top_k / E of their stacks; not the embedding lookup or
1-D norms). The second term is attention's QK^T and AV under a causal mask: query i attends to
i + 1 keys, (S + 1) / 2 on average, each key costing 2 * 2 * H * Dh FLOPs forward. (PaLM's
appendix B counts all S keys, 12 * L * H * Dh * S, twice this; the JSON has both.) Activation
checkpointing's recomputed forward is not model work and is not counted. Peak = 989 TFLOP/s,
the dense BF16 peak of the H100/H200 class.

Configurations (`--configs`, comma-separated): a recipe with optional levers after `@`, e.g.
`bf16`, `mxfp4@compile`, `bf16@compile@cudnn`. Levers: `compile` compiles each decoder layer
(`nn.Module.compile`, regional, as torchtitan does); `plain-loss` makes the [B, S, V] logits and
runs `F.cross_entropy` on them (what `return_logits=True` does) instead of the chunked head and
loss; `no-det` turns the trainer's deterministic mode off; `cudnn` / `flash` pin SDPA's backend.

Categories (`--profile`): kernel time by kernel name (GEMMs dense and grouped, attention, fake
quantization, optimizer, gradient norm and clip, dtype copies, the rest as elementwise and
reductions), per step. With $OUT set, writes bench_step_gpu.json and bench_step_gpu.md there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch

PEAK = 989e12  # FLOP/s, dense bf16, H100/H200 class (NVIDIA datasheet)
QAT_RECIPES = ("mxfp4", "mxfp4+mxfp8", "nvfp4", "nvfp4+mxfp8")
LEVERS = ("compile", "plain-loss", "no-det", "cudnn", "flash")
DEFAULT_CONFIGS = ",".join(["bf16", *QAT_RECIPES, "bf16@compile",
                            *(f"{r}@compile" for r in QAT_RECIPES), "bf16@compile@no-det",
                            "bf16@compile@cudnn", "bf16@plain-loss"])

# kernel name -> category; first match wins (names as CUPTI reports them)
CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("fake quantization", re.compile(r"mx_kernel|nvfp4_kernel|amax_kernel|swiglu_", re.I)),
    ("optimizer", re.compile(r"adamw|addcdiv", re.I)),
    ("grad norm + clip", re.compile(r"sumsq|multi_tensor_apply", re.I)),
    ("grouped GEMM", re.compile(r"group", re.I)),
    ("dense GEMM", re.compile(r"gemm|xmma|nvjet|cutlass|wgmma|sm90_", re.I)),
    ("dtype copies", re.compile(r"copy|widen|cast", re.I)),
    ("elementwise + reductions", re.compile(r".")),
)


def flops_per_token(model, seq: int) -> dict:
    from workbench.model import is_expert_param

    cfg = model.config
    dense = expert = 0
    embed = model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        if p.dim() < 2 or (p is embed and not cfg.tie_embeddings):
            continue
        if is_expert_param(model, name):
            expert += p.numel()
        else:
            dense += p.numel()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    n_active = dense + expert * world * cfg.top_k / cfg.num_experts
    lhd = cfg.num_layers * cfg.num_heads * cfg.head_dim
    return {"n_active": n_active, "causal": 6 * n_active + 6 * lhd * (seq + 1),
            "palm": 6 * n_active + 12 * lhd * seq}


def categorize(kernels: dict[str, float]) -> dict[str, float]:
    out = {name: 0.0 for name, _ in CATEGORIES}
    for kname, ms in kernels.items():
        for cat, pattern in CATEGORIES:
            if pattern.search(kname):
                out[cat] += ms
                break
    return out


def profile_steps(n: int, step, device: torch.device) -> dict:
    """Kernel ms per step by kernel name over ``n`` profiled steps, and the profiled wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(n):
            step(i)
        wall = time.perf_counter() - t0
    want = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != want or getattr(e, "is_user_annotation", False) \
                or (want == DeviceType.CPU and e.cpu_parent is not None):
            continue
        us = e.time_range.elapsed_us() if want == DeviceType.CUDA else e.self_cpu_time_total
        per[e.name] = per.get(e.name, 0.0) + us / 1e3 / n
    return {"wall_ms": wall * 1e3 / n, "busy_ms": sum(per.values()), "kernels": per}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3_30b_a3b_like")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (0: the preset's)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", default="32,16,8,4",
                    help="sequences per step; a list tries each, largest first, until one fits")
    ap.add_argument("--act-ckpt", default="full", choices=("off", "full", "selective"))
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="RECIPE[@LEVER...] entries, comma-separated (see the module doc)")
    ap.add_argument("--steps", type=int, default=3, help="steps per configuration per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (the first is warm-up)")
    ap.add_argument("--profile", type=int, default=2, metavar="N",
                    help="profiled steps per configuration after the timed rounds (0: none)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a dry run of the job)")
    args = ap.parse_args(argv)
    plan_keys = []
    for entry in filter(None, args.configs.split(",")):
        recipe, *levers = entry.split("@")
        bad = [lv for lv in levers if lv not in LEVERS]
        if bad:
            ap.error(f"unknown lever {bad[0]!r} in {entry!r}; choose from {', '.join(LEVERS)}")
        plan_keys.append((recipe, tuple(levers)))

    from tqdm.auto import tqdm

    from workbench.arch import PRESETS, preset, register_preset
    from workbench.qat import prepare, unprepare
    from workbench.train.args import config_from_args
    from workbench.train.build import QAT_SCOPE, build
    from workbench.train.data import load_corpus
    from workbench.train.determinism import enable as enable_determinism
    from workbench.train.distributed import DistInfo

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    info = DistInfo(0, 1, 0, device, None, False)
    name = args.preset
    if args.layers:
        name = f"{args.preset}-L{args.layers}"
        if name not in PRESETS:
            register_preset(name, lambda **kw: preset(args.preset, **kw).with_layers(args.layers))
    tokens = load_corpus().train
    batches = [int(b) for b in args.batch.split(",")]
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "preset": name,
            "seq": args.seq, "act_ckpt": args.act_ckpt}
    with contextlib.suppress(ImportError):
        import triton

        meta["triton"] = triton.__version__
    print("[bench_step_gpu] " + json.dumps(meta), flush=True)

    def config(batch: int, recipe: str = "bf16"):
        return config_from_args(["--preset", name, "--recipe", recipe, "--steps", "100000",
                                 "--batch", str(batch), "--seq", str(args.seq), "--out", "unused",
                                 "--wandb", "disabled", "--activation-checkpointing",
                                 args.act_ckpt])

    from workbench.train.loop import train_step

    enable_determinism(True)
    # one compiled graph per (recipe, lever) variant of the same layer code: keep them all
    torch._dynamo.config.cache_size_limit = 64
    held: dict = {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    pinned: list = []

    def enter(recipe: str, levers: tuple[str, ...]):
        torch.use_deterministic_algorithms("no-det" not in levers)
        model = held["model"]
        if recipe != "bf16":
            prepare(model, recipe, QAT_SCOPE)
        if "compile" in levers:
            for layer in model.model.layers:
                layer.compile()
        for lv in levers:
            if lv in backends:
                pinned.append(sdpa_kernel([backends[lv]]))
                pinned[-1].__enter__()

    def leave(recipe: str, levers: tuple[str, ...]):
        while pinned:
            pinned.pop().__exit__(None, None, None)
        model = held["model"]
        if recipe != "bf16":
            unprepare(model)
        if "compile" in levers:
            for layer in model.model.layers:
                layer._compiled_call_impl = None  # back to eager (nn.Module.compile's slot)
        torch.use_deterministic_algorithms(True)

    def fits(built, cfg) -> bool:
        """One step of every configuration at this batch: compiled and QAT steps need more
        memory than the eager BF16 one, so each is tried before the batch is taken."""
        held["model"] = built.model
        for step, key in enumerate(plan_keys, start=1):
            try:
                enter(*key)
                train_step(built.model, built.opt, built.sched, tokens, config(cfg.batch, key[0]),
                           info, step, logits="plain-loss" in key[1])
            except torch.OutOfMemoryError:
                if key == plan_keys[0] or "plain-loss" not in key[1]:
                    return False
                # the [B, S, V] logits are a lever that may not fit: its row says so
            finally:
                built.opt.zero_grad(set_to_none=True)
                leave(*key)
        return True

    built = cfg = None
    for batch in batches:  # the largest global batch whose step fits, in every configuration
        try:
            cfg = config(batch)
            torch.manual_seed(0)
            built = build(cfg, info)
            if fits(built, cfg):
                break
        except torch.OutOfMemoryError:
            pass
        built = held["model"] = None
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[bench_step_gpu] batch {batch} x {args.seq} does not fit; trying smaller",
              flush=True)
    if built is None:
        print("[bench_step_gpu] no batch fits", flush=True)
        return 1
    meta["batch"] = cfg.batch
    meta["tokens_per_step"] = cfg.batch * cfg.seq
    model, opt, sched = built.model, built.opt, built.sched
    flops = flops_per_token(model, cfg.seq)

    step_no = [1]

    def one_step(recipe: str, levers: tuple[str, ...]) -> dict:
        step_no[0] += 1
        rcfg = config(cfg.batch, recipe)
        return train_step(model, opt, sched, tokens, rcfg, info, step_no[0],
                          logits="plain-loss" in levers)

    rows = {c: {"times": [], "peak": 0.0} for c in plan_keys}
    plan = [(r, c) for r in range(args.rounds) for c in plan_keys]
    for rnd, key in tqdm(plan, desc="configurations x rounds"):
        if "error" in rows[key]:
            continue
        try:
            enter(*key)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(args.steps):
                rec = one_step(*key)
                if rnd > 0:
                    rows[key]["times"].append(rec["step_time_s"])
            if device.type == "cuda":
                rows[key]["peak"] = max(rows[key]["peak"],
                                        torch.cuda.max_memory_allocated(device) / 2**30)
        except Exception as e:  # a lever that cannot run here is a row, not a lost run
            rows[key]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(f"[bench_step_gpu] {key}: {rows[key]['error']}", flush=True)
            opt.zero_grad(set_to_none=True)  # a step cut short leaves its gradients
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            leave(*key)
    if args.profile:
        for key in tqdm(list(rows), desc="profiles"):
            if "error" in rows[key]:
                continue
            try:
                enter(*key)
                rows[key]["profile"] = profile_steps(args.profile, lambda i, k=key: one_step(*k),
                                                     device)
            finally:
                leave(*key)

    tokens_step = cfg.batch * cfg.seq
    first_bf16 = next((k for k in plan_keys if k[0] == "bf16" and rows[k]["times"]), None)

    def base_of(levers: tuple[str, ...]) -> float:
        """The BF16 step with the same levers (QAT's cost in that mode), else the first BF16 row."""
        same = ("bf16", levers)
        key = same if same in rows and rows[same]["times"] else first_bf16
        return statistics.median(rows[key]["times"]) if key else float("nan")
    lines = [f"`python jobs/bench_step_gpu.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
             .replace("  ", " "), "",
             f"{meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, Triton "
             f"{meta.get('triton', '-')}; preset {name}, batch {cfg.batch} x seq {cfg.seq} = "
             f"{tokens_step} tokens/step, activation checkpointing {args.act_ckpt}, "
             f"deterministic mode on unless noted; N_active {flops['n_active'] / 1e9:.3f}B; "
             f"median of {args.rounds - 1} rounds x {args.steps} steps", "",
             "| configuration | wall ms/step | GPU busy ms/step | tokens/s/GPU | TFLOP/s | MFU | "
             "peak GiB | vs BF16, same levers |", "|---|---|---|---|---|---|---|---|"]
    out_rows = []
    for (recipe, levers), r in rows.items():
        label = "@".join((recipe, *levers))
        if "error" in r or not r["times"]:
            lines.append(f"| {label} | not run: {r.get('error', 'no steps')} | | | | | | |")
            out_rows.append({"recipe": recipe, "levers": levers, "error": r.get("error")})
            continue
        dt = statistics.median(r["times"])
        base = base_of(levers)
        tflops = flops["causal"] * tokens_step / dt / 1e12
        busy = r.get("profile", {}).get("busy_ms", float("nan"))
        lines.append(f"| {label} | {dt * 1e3:.1f} | {busy:.1f} | {tokens_step / dt:.0f} | "
                     f"{tflops:.0f} | {100 * tflops * 1e12 / PEAK:.1f}% | {r['peak']:.1f} | "
                     f"{dt / base:.3f}x |")
        out_rows.append({"recipe": recipe, "levers": levers, "ms_per_step": dt * 1e3,
                         "times_s": r["times"], "busy_ms": busy, "peak_gib": r["peak"],
                         "tokens_per_s_per_gpu": tokens_step / dt, "tflops": tflops,
                         "mfu": tflops * 1e12 / PEAK,
                         "mfu_palm": flops["palm"] * tokens_step / dt / PEAK,
                         "vs_bf16": dt / base, "profile": r.get("profile")})
    profiled = [(k, r["profile"]) for k, r in rows.items() if r.get("profile")]
    if profiled:
        cats = [name for name, _ in CATEGORIES]
        lines += ["", "GPU kernel time per step by category (ms; by kernel name)", "",
                  "| configuration | " + " | ".join(cats) + " | busy | profiled wall |",
                  "|---|" + "---|" * (len(cats) + 2)]
        for key, p in profiled:
            c = categorize(p["kernels"])
            label = "@".join((key[0], *key[1]))
            lines.append(f"| {label} | " + " | ".join(f"{c[n]:.1f}" for n in cats)
                         + f" | {p['busy_ms']:.1f} | {p['wall_ms']:.1f} |")
        for key, p in profiled[:1] + [kp for kp in profiled if "compile" in kp[0][1]][:1]:
            top = sorted(p["kernels"].items(), key=lambda kv: -kv[1])[:20]
            lines += ["", f"{'@'.join((key[0], *key[1]))}: the 20 largest kernels (ms per step)",
                      "", "| kernel | ms |", "|---|---|"]
            lines += [f"| `{k[:90]}` | {ms:.2f} |" for k, ms in top]
    table = "\n".join(lines)
    print(table, flush=True)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_step_gpu.json").write_text(json.dumps(
            {"meta": meta, "flops_per_token": flops, "rows": out_rows}, indent=1) + "\n")
        (out / "bench_step_gpu.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
