"""Trainer speed on one GPU: BF16 and every QAT recipe, deterministic mode on and off, one run.

    python jobs/bench_train_gpu.py                        # qwen3_30b_a3b_like (4 layers), batch 8, seq 512
    python jobs/bench_train_gpu.py --preset tiny --steps 4 --batch 4 --seq 32   # CPU dry run

Every configuration is a fresh model and optimizer (seed 0, the trainer's `build`) stepped with
the trainer's own `train_step` on the same global batches; the table reports medians over the
steps after `--warmup`. One configuration at a time holds the GPU (a 4-layer
qwen3_30b_a3b_like trainer state is about 50 GB: fp32 masters, gradients, two Adam moments).

Columns:
- `ms/step`, `tokens/s/GPU` (global tokens / step time / world size, as the trainer logs it);
- `MFU`: model FLOPs per step / step time / peak, peak = 989 TFLOP/s (H200 dense bf16, datasheet).
  Model FLOPs per step = 6 * N_active * tokens + 12 * L * H * Dh * S * tokens, where N_active
  counts every matrix the forward multiplies a token by (attention, router, dense and shared
  FFNs, lm_head; not the embedding lookup, not 1-D norms) plus top_k / E of the routed experts,
  and the second term is attention's QK^T and AV (forward + backward, non-causal counting as in
  PaLM's appendix B; causal kernels skip half of it). Fake quantization is not model work: every
  recipe is charged the same FLOPs, so MFU falls as QAT overhead grows;
- `peak GiB`: `torch.cuda.max_memory_allocated` during the configuration (peak RSS on CPU);
- `fq share`: the trainer's `fake_quant_share` metric (fraction of the step in fake quantization);
- `vs bf16`: step time over the BF16 run's (deterministic off), `det cost`: deterministic over
  non-deterministic step time for the same recipe.

Determinism (docs/determinism.md): `CUBLAS_WORKSPACE_CONFIG` is set for the whole process
before CUDA starts (cuBLAS reads it once), so the "off" runs differ from the "on" runs only by
`torch.use_deterministic_algorithms`. Two fresh deterministic BF16 runs are compared loss for
loss (bitwise), and two fresh non-deterministic ones to show what the switch fixes. One more
deterministic BF16 run leaves out PyTorch's NaN fill of fresh allocations
(`torch.utils.deterministic.fill_uninitialized_memory = False`), to show how much of the cost
that fill is.
With $OUT set, writes bench_train_gpu.json and bench_train_gpu.md there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

# Before torch can create a cuBLAS handle (see the module doc).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

H200_BF16_PEAK = 989e12  # FLOP/s, dense bf16 (NVIDIA datasheet)
QAT_RECIPES = ("mxfp4", "mxfp4+mxfp8", "nvfp4", "nvfp4+mxfp8")


def model_flops_per_token(model, seq: int) -> tuple[float, float]:
    """(6 * N_active + attention term, N_active) per trained token; see the module doc."""
    from workbench.model import is_expert_param

    mcfg = model.config
    dense = expert = 0
    embed = model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        if p.dim() < 2 or (p is embed and not mcfg.tie_embeddings):
            continue
        if is_expert_param(model, name):
            expert += p.numel()
        else:
            dense += p.numel()
    # under EP each rank holds num_experts / world experts; count the global stack
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    n_active = dense + expert * world * mcfg.top_k / mcfg.num_experts
    attn = 12 * mcfg.num_layers * mcfg.num_heads * mcfg.head_dim * seq
    return 6 * n_active + attn, n_active


def _peak_gib(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


_INIT: dict = {}


def run_config(args, recipe: str, deterministic: bool, info, tokens, nan_fill: bool = True,
               fused: bool = True, profile: int = 0) -> dict:
    from workbench.qat import prepare, unprepare
    from workbench.recipe import RecipeError, parse_qat_recipe
    from workbench.train.args import config_from_args
    from workbench.train.build import QAT_SCOPE, build
    from workbench.train.fqtime import FakeQuantTimer
    from workbench.train.loop import train_step

    try:  # the trainer's own grammar: a recipe it cannot train is a row, not a crash
        parse_qat_recipe(recipe)
    except RecipeError as e:
        return {"recipe": recipe, "deterministic": deterministic, "error": str(e)}
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = nan_fill
    cfg = config_from_args(["--preset", args.preset, "--recipe", recipe,
                            "--steps", str(args.steps), "--batch", str(args.batch),
                            "--seq", str(args.seq), "--out", "unused", "--wandb", "disabled",
                            *(["--deterministic"] if deterministic else [])])
    if info.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(info.device)
    torch.manual_seed(cfg.seed + info.rank)
    t0 = time.perf_counter()
    # The seeded initialisation is drawn on the CPU (about a minute for this preset): draw it
    # once, keep it on the device, and give every configuration the same starting weights
    # through the resume path's uninitialised build (parameters stay the objects QAT and the
    # optimizer hold).
    if "sd" not in _INIT:
        _INIT["sd"] = {k: v.detach().clone() for k, v in build(cfg, info).model.state_dict().items()}
    b = build(cfg, info, resuming=True)
    b.model.load_state_dict(_INIT["sd"])
    if not fused and b.qat_report is not None:
        # the same masters, optimizer and amax book, the down projection quantizing its input
        unprepare(b.model)
        prepare(b.model, cfg.qat_recipe, QAT_SCOPE, fuse_swiglu=False, state=b.qat_state)
    build_s = time.perf_counter() - t0
    flops_tok, n_active = model_flops_per_token(b.model, cfg.seq)
    recs = []
    b.model.train()
    with FakeQuantTimer() as timer:
        for step in range(1, cfg.steps + 1):
            recs.append(train_step(b.model, b.opt, b.sched, tokens, cfg, info, step, timer))
        peak = _peak_gib(info.device)
        kernels = _profile(profile, lambda step, b=b: train_step(
            b.model, b.opt, b.sched, tokens, cfg, info, cfg.steps + step, timer), info.device)
    del b
    gc.collect()
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
    timed = recs[args.warmup:] or recs
    dt = statistics.median(r["step_time_s"] for r in timed)
    tokens_step = cfg.batch * cfg.seq
    torch.utils.deterministic.fill_uninitialized_memory = True
    return {"recipe": recipe, "deterministic": deterministic, "nan_fill": nan_fill,
            "fused_swiglu": fused, "build_s": build_s, "kernels": kernels,
            "ms_per_step": dt * 1e3, "tokens_per_s_per_gpu": tokens_step / dt / info.world,
            "mfu": flops_tok * tokens_step / dt / info.world / H200_BF16_PEAK,
            "model_tflop_per_step": flops_tok * tokens_step / 1e12, "n_active": n_active,
            "peak_gib": peak,
            "fake_quant_share": statistics.median(r.get("fake_quant_share", 0.0) for r in timed),
            "losses": [r["loss"] for r in recs]}


def _profile(n: int, step, dev: torch.device) -> dict | None:
    """``n`` more steps under torch.profiler: {"wall_ms", "busy_ms", "kernels": {name: ms}},
    per step. On a GPU, busy is the sum of kernel durations (one stream: the time the GPU
    worked), so wall - busy is time the GPU waited for the host. On a CPU (dry runs) the
    "kernels" are the top-level ops' self times."""
    if n <= 0:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    # shapes, to tell which tensors the copies are (the profiled steps are not the timed ones)
    with profile(activities=acts, record_shapes=True) as prof:
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            step(i)  # ends in the step's own host synchronisation (the loss .item())
        wall = time.perf_counter() - t0
    want = DeviceType.CUDA if dev.type == "cuda" else DeviceType.CPU
    per: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        # user annotations (record_function ranges, e.g. "Optimizer.step#AdamW.step") also have
        # a GPU-side twin: a range over other kernels, not work of its own
        if e.device_type != want or getattr(e, "is_user_annotation", False) \
                or (want == DeviceType.CPU and e.cpu_parent is not None):
            continue
        us = e.time_range.elapsed_us() if want == DeviceType.CUDA else e.self_cpu_time_total
        per[e.name] = per.get(e.name, 0.0) + us / 1e3 / n
        launches += 1
    # the same GPU time by the op that launched it (aten::copy_, aten::pow, our autograd
    # Functions, record_function ranges such as the optimizer step), to tell kernels apart
    # whose templated names look alike
    attr = "self_device_time_total" if want == DeviceType.CUDA else "self_cpu_time_total"
    ops = {a.key: getattr(a, attr) / 1e3 / n for a in prof.key_averages()
           if getattr(a, attr, 0) > 0}
    return {"wall_ms": wall * 1e3 / n, "busy_ms": sum(per.values()), "launches": launches / n,
            "kernels": per, "ops": ops, "copies": _copy_sites(prof, n)}


def _copy_sites(prof, n: int) -> dict[str, float]:
    """GPU ms per step of the kernels ``aten::copy_`` launched, by (the op above the copy, the
    copy's operand shapes, the kernel): dtype casts of weights and gradients show as their
    parameters' shapes, and the kernel name says whether the copy took a vectorised path."""
    sites: dict[str, float] = {}
    for e in prof.events():
        if e.name != "aten::copy_" or not getattr(e, "kernels", None):
            continue
        up, names = e.cpu_parent, []
        while up is not None and len(names) < 2:
            names.append(up.name)
            up = up.cpu_parent
        shapes = "x".join(str(list(s)) for s in (e.input_shapes or [])[:2])
        for k in e.kernels:
            key = f"{' < '.join(names) or '-'} | {shapes} | {_short(k.name, 48)}"
            sites[key] = sites.get(key, 0.0) + k.duration / 1e3 / n
    return sites


def _short(name: str, width: int = 70) -> str:
    name = name.split("(")[0] if name.startswith("void ") else name
    return name if len(name) <= width else name[:width - 3] + "..."


def _ab_table(rows: list[dict]) -> str:
    """The SwiGLU fusion A/B: step times, and where profiled, GPU busy time and the kernels
    whose time per step moved most between the fused and unfused runs of each recipe."""
    out = [("| recipe | fused SwiGLU | ms/step | profiled wall ms/step | GPU busy ms/step |"
            " kernels/step |"), "|---|---|---|---|---|---|"]
    ab = [r for r in rows if "error" not in r and r.get("ab")]
    for r in ab:
        k = r.get("kernels") or {}
        out.append(f"| {r['recipe']} | {r['fused_swiglu']} | {r['ms_per_step']:.1f} | "
                   f"{k.get('wall_ms', float('nan')):.1f} | {k.get('busy_ms', float('nan')):.2f} | "
                   f"{k.get('launches', float('nan')):.0f} |")
    for recipe in dict.fromkeys(r["recipe"] for r in ab):
        on = next((r["kernels"] for r in ab if r["recipe"] == recipe and r["fused_swiglu"]
                   and r.get("kernels")), None)
        off = next((r["kernels"] for r in ab if r["recipe"] == recipe and not r["fused_swiglu"]
                    and r.get("kernels")), None)
        if on is None or off is None:
            continue
        names = set(on["kernels"]) | set(off["kernels"])
        moved = sorted(names, key=lambda n: -abs(on["kernels"].get(n, 0) - off["kernels"].get(n, 0)))
        out += ["", (f"{recipe}: kernels whose time moved most (ms per step; busy fused "
                     f"{on['busy_ms']:.2f} vs unfused {off['busy_ms']:.2f})"), "",
                "| kernel | fused | unfused | fused - unfused |", "|---|---|---|---|"]
        for n in moved[:12]:
            a, b = on["kernels"].get(n, 0.0), off["kernels"].get(n, 0.0)
            out.append(f"| `{_short(n)}` | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
    return "\n".join(out)


def _where_table(row: dict, top: int = 15) -> str:
    """Where a profiled step's GPU time goes, by the op that launched the kernels."""
    k = row["kernels"]
    ops = sorted(k["ops"].items(), key=lambda kv: -kv[1])[:top]
    lines = [(f"{row['recipe']} (fused SwiGLU {row['fused_swiglu']}): GPU busy "
              f"{k['busy_ms']:.1f} ms of {k['wall_ms']:.1f} ms per profiled step"), "",
             "| op (launcher) | GPU ms/step | share of busy |", "|---|---|---|"]
    lines += [f"| `{_short(name)}` | {ms:.2f} | {100 * ms / k['busy_ms']:.1f}% |" for name, ms in ops]
    copies = sorted((k.get("copies") or {}).items(), key=lambda kv: -kv[1])[:top]
    if copies:
        lines += ["", f"{row['recipe']}: `aten::copy_` by caller, operand shapes and kernel", "",
                  "| caller < its caller | shapes (dst x src) | kernel | GPU ms/step |",
                  "|---|---|---|---|"]
        lines += ["| " + " | ".join(f"`{part.strip()}`" for part in key.split(" | "))
                  + f" | {ms:.2f} |" for key, ms in copies]
    return "\n".join(lines)


def _table(rows: list[dict], base: dict) -> str:
    head = ("| recipe | deterministic | ms/step | tokens/s/GPU | MFU | peak GiB | fq share | vs bf16 |"
            " det cost |\n|---|---|---|---|---|---|---|---|---|")
    off = {r["recipe"]: r for r in rows if not r["deterministic"] and "error" not in r}
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['deterministic']} | not run: {r['error'][:60]} "
                         "| | | | | | |")
            continue
        cost = ""
        det = f"{r['deterministic']}{'' if r.get('nan_fill', True) else ' (no NaN fill)'}"
        if r["deterministic"] and r["recipe"] in off:
            cost = f"{r['ms_per_step'] / off[r['recipe']]['ms_per_step']:.3f}x"
        lines.append(
            f"| {r['recipe']} | {det} | {r['ms_per_step']:.1f} | "
            f"{r['tokens_per_s_per_gpu']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
            f"{100 * r['fake_quant_share']:.1f}% | {r['ms_per_step'] / base['ms_per_step']:.3f}x | "
            f"{cost} |")
    return "\n".join(lines)


def _fusable(recipe: str) -> bool:
    """Whether the fused SwiGLU serves this recipe's activations (an MX format)."""
    from workbench.formats import format_spec
    from workbench.recipe import RecipeError, parse_qat_recipe

    try:
        act = parse_qat_recipe(recipe).act
    except RecipeError:
        return False
    return act is not None and format_spec(act.fmt).scale == "e8m0"


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3_30b_a3b_like")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--recipes", default=",".join(QAT_RECIPES), help="QAT recipes besides bf16")
    ap.add_argument("--qat-deterministic", action="store_true",
                    help="also time every QAT recipe with deterministic mode on")
    ap.add_argument("--swiglu-ab", action="store_true",
                    help="time the recipes whose activations the fused SwiGLU serves (MX) again "
                         "fused, unfused, fused, and add the A/B table")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each configuration's timed steps, N more under torch.profiler: "
                         "GPU busy time and kernel times per step (in the JSON and the A/B table)")
    args = ap.parse_args(argv)

    from workbench.train import distributed
    from workbench.train.data import load_corpus

    info = distributed.setup()
    tokens = load_corpus().train
    dev = info.device
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "preset": args.preset,
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "world": info.world, "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"]}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if info.is_main:
        print("[bench_train_gpu] " + json.dumps(meta), flush=True)
    recipes = [r for r in args.recipes.split(",") if r]
    # (recipe, deterministic, NaN fill, fused SwiGLU, part of the A/B)
    plan = [("bf16", False, True, True, False), ("bf16", True, True, True, False),
            ("bf16", True, True, True, False), ("bf16", False, True, True, False),
            ("bf16", True, False, True, False)]
    plan += [(r, False, True, True, False) for r in recipes]
    if args.qat_deterministic:
        plan += [(r, True, True, True, False) for r in recipes]
    if args.swiglu_ab:
        # interleaved, so drift over the run shows as fused-vs-fused spread
        plan += [(r, False, True, f, True) for r in recipes if _fusable(r)
                 for f in (True, False, True)]
        plan += [("bf16", False, True, True, True)]
    from tqdm.auto import tqdm

    rows = []
    for recipe, det, fill, fused, ab in tqdm(plan, desc="configurations", disable=not info.is_main):
        # with the A/B, only its rows are profiled (the profiler's own cost stays out of the rest)
        prof = args.profile if ab or not args.swiglu_ab else 0
        rows.append(run_config(args, recipe, det, info, tokens, nan_fill=fill, fused=fused,
                               profile=prof))
        r = rows[-1]
        r["ab"] = ab
        if info.is_main:
            print(f"[bench_train_gpu] {recipe} deterministic={det} nan_fill={fill} fused={fused}: "
                  + (r["error"] if "error" in r else
                     f"{r['ms_per_step']:.1f} ms/step, build {r['build_s']:.0f} s, "
                     f"peak {r['peak_gib']:.1f} GiB"), flush=True)
    torch.use_deterministic_algorithms(False)
    # runs 0/3: two fresh non-deterministic BF16 runs; 1/2: two fresh deterministic ones
    off_a, on_a, on_b, off_b = rows[:4]
    repro = {"deterministic_identical": on_a["losses"] == on_b["losses"],
             "deterministic_max_abs_diff": _max_diff(on_a["losses"], on_b["losses"]),
             "nondeterministic_identical": off_a["losses"] == off_b["losses"],
             "nondeterministic_max_abs_diff": _max_diff(off_a["losses"], off_b["losses"])}
    shown = [rows[0], rows[1], rows[4]] + [r for r in rows[5:] if not r["ab"]]
    table = _table(shown, off_a)
    if args.swiglu_ab:
        table += "\n\nSwiGLU fusion A/B (same process, interleaved)\n\n" + _ab_table(rows)
    for name in ("bf16", next((r for r in recipes if _fusable(r)), None)):
        prof = next((r for r in rows if r["recipe"] == name and r.get("kernels")), None)
        if prof is not None:
            table += "\n\n" + _where_table(prof)
    # The trainer's deterministic mode leaves PyTorch's NaN fill of new memory off
    # (workbench.train.determinism): rows[4] is that mode; rows[1] adds the fill.
    det_cost = rows[4]["ms_per_step"] / off_a["ms_per_step"]
    fill_cost = on_a["ms_per_step"] / off_a["ms_per_step"]
    summary = (f"deterministic mode (the trainer's: no NaN fill) costs {100 * (det_cost - 1):+.1f}% "
               f"on BF16 (5% rule: {'make it the default' if det_cost <= 1.05 else 'keep it off by default'}; "
               f"with PyTorch's NaN fill of new memory {100 * (fill_cost - 1):+.1f}%); "
               f"two fresh seeded runs, {args.steps} steps: deterministic identical "
               f"{repro['deterministic_identical']} (max |diff| {repro['deterministic_max_abs_diff']:.3g}), "
               f"non-deterministic identical {repro['nondeterministic_identical']} "
               f"(max |diff| {repro['nondeterministic_max_abs_diff']:.3g})")
    if info.is_main:
        print(table)
        print(summary, flush=True)
        if os.environ.get("OUT"):
            out = Path(os.environ["OUT"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_train_gpu.json").write_text(json.dumps(
                {"meta": meta, "rows": rows, "reproducibility": repro,
                 "deterministic_cost": det_cost, "deterministic_nan_fill_cost": fill_cost}, indent=1) + "\n")
            cmd = "python jobs/bench_train_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
            (out / "bench_train_gpu.md").write_text(
                f"{json.dumps(meta)}\n\n`{cmd.strip()}`\n\n{table}\n\n{summary}\n")
    distributed.teardown(info)
    return 0 if repro["deterministic_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
