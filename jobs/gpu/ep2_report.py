"""Checks and numbers of the EP2 protocol, from what its steps left in the work folder.

    python jobs/gpu/ep2_report.py --work W --out OUT [--command "the protocol command"]

Reads W/{init, bf16, qat} (see `ep2_protocol.sh`), and writes OUT/summary.json and
OUT/summary.md (also printed). Every part tolerates a missing step, so a protocol cut short by
its time limit still reports what it did. Parts:

- export: the QAT run's compressed-tensors export re-opened with `workbench.checkpoint`; every
  routed expert's stored codes and scales are compared with `workbench.formats.quantize` of the
  same master read back from the run's final DCP checkpoint (an independent path: DCP reader +
  reference codec, against the trainer's `convert` + export + checkpoint reader).
- resume: losses of the steps computed both before the SIGKILL and after the resume.
- fake-quant share: the trainer does not log it (its ops run inside the grouped-GEMM seam), so
  the grouped-GEMM seam is timed in isolation, with and without the recipe, forward + backward,
  at the per-rank shapes of one step; (difference x GEMMs per step) / median QAT step time.
- budgets: `workbench.track.compare` of the BF16 and QAT run folders (default budgets).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep2_driver import REPO, _write_json, ensure_preset

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _part(summary: dict, name: str, fn, *a):
    """Run one report part; its failure is recorded, not fatal."""
    t0 = time.perf_counter()
    try:
        summary[name] = fn(*a)
    except Exception as e:  # noqa: BLE001 - record the failure; the other parts still report
        summary[name] = {"error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc(limit=4)}
    summary.setdefault("report_s", {})[name] = round(time.perf_counter() - t0, 2)


# --- runs --------------------------------------------------------------------------------

def run_stats(folder: Path) -> dict:
    from workbench.track.metrics import read_metrics

    df = read_metrics(folder)
    cfg = _json(folder / "config.json") or {}
    world = int(cfg.get("world_size", 1))
    steady = df[df["step"] > 2] if len(df) > 2 else df  # first steps: allocator, autotuning
    val = df["val_loss"].dropna() if "val_loss" in df else []
    out = {"recipe": cfg.get("recipe"), "preset": cfg.get("preset"), "world_size": world,
           "steps_logged": len(df), "last_step": int(df["step"].max()),
           "steps_contiguous": list(df["step"]) == list(range(1, int(df["step"].max()) + 1)),
           "first_loss": float(df["loss"].iloc[0]), "final_loss": float(df["loss"].iloc[-1]),
           "final_val_loss": float(val.iloc[-1]) if len(val) else None,
           "median_step_s": float(steady["step_time_s"].median()),
           "median_tokens_per_s": float(steady["tokens_per_s"].median()),
           "tokens_per_step": int(cfg.get("batch", 0)) * int(cfg.get("seq", 0))}
    out["median_tokens_per_s_per_gpu"] = out["median_tokens_per_s"] / world
    if "peak_mem_gib" in df:
        out["peak_mem_gib_rank0"] = float(df["peak_mem_gib"].max())
    result = _json(folder / "result.json")
    if result:
        out["result"] = result
    return out


def resume_check(qat: Path) -> dict:
    from workbench.track.metrics import read_metrics

    def losses(path):
        df = read_metrics(path, missing_ok=True)
        return dict(zip(df["step"].astype(int), df["loss"]))

    kill = _json(qat.parent / f"{qat.name}.kill.json") or {}
    before = losses(qat.parent / f"{qat.name}.metrics_before_kill.jsonl")
    after = losses(qat)
    resumed_from = max(kill.get("complete_checkpoints") or [0])
    both = sorted(s for s in before if s > resumed_from and s in after)
    diffs = [abs(before[s] - after[s]) for s in both]
    return {"killed_at_step": kill.get("last_metrics_step"), "resumed_from_step": resumed_from,
            "survivors": kill.get("survivors"), "partial_checkpoints": kill.get(
                "partial_checkpoints"), "steps_recomputed": len(both),
            "max_abs_loss_diff": max(diffs) if diffs else None,
            "bit_exact": bool(both) and all(d == 0 for d in diffs)}


def load_probe(work: Path) -> dict:
    recs = _json(work / "bf16.load_probe.json")
    init = _json(work / "init_stats.json") or {}
    if not recs:
        return {"error": "no bf16.load_probe.json"}
    world = len(recs)
    own = init.get("dense_bytes", 0) + init.get("expert_bytes", 0) / world
    return {"ranks": recs, "checkpoint_expert_bytes": init.get("expert_bytes"),
            "checkpoint_dense_bytes": init.get("dense_bytes"),
            "expected_bytes_per_rank": own,
            "bytes_read_over_expected": [r["bytes_read"] / own for r in recs] if own else None}


# --- export ------------------------------------------------------------------------------

def export_check(qat: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from workbench.checkpoint import open_checkpoint
    from workbench.checkpoint.grid import stored_grid
    from workbench.formats import dequantize, quantize
    from workbench.qat.recipe import parse_qat_recipe

    cfg = _json(qat / "config.json")
    result = _json(qat / "result.json") or {}
    ensure_preset(cfg["preset"])
    ck = open_checkpoint(result.get("export", qat / "export"))
    recipe = parse_qat_recipe(cfg["recipe"], cfg.get("profile")).weight
    recs = ck.experts()
    layers = sorted({r.layer for r in recs})
    ckpt = Path(result["checkpoint"])
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    world = int(cfg.get("world_size", 1))
    mismatched, decoded_mismatch, compared, decoded = [], 0, 0, 0
    for layer in layers:
        for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            key = f"model/model.layers.{layer}.mlp.experts.{w}"
            n = ck.num_experts(layer)
            shape = tuple(ck.record(layer, 0, proj).shape)
            sd = {key: torch.empty((n, *shape), dtype=torch.float32)}
            dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
            # Decoding to BF16 runs on the CPU: check it at each rank's first and last expert
            # (the grid bytes, which the decode is a pure function of, are compared for all).
            decode_at = {0, n // world - 1, n // world, n - 1} if world > 1 else {0, n - 1}
            for e in range(n):
                # each expert alone, as each expert Linear is stored: NVFP4's per-tensor scale
                # is that expert's own amax (a quantization of the whole stack would share one)
                q = quantize(sd[key][e].to(dev), recipe)
                g = stored_grid(ck, ck.record(layer, e, proj))
                same = (torch.equal(g.data.to(dev), q.data) and
                        torch.equal(g.scale.to(dev), q.scale))
                if not same:
                    mismatched.append(f"layer {layer} expert {e} {proj}")
                compared += 1
                if e not in decode_at:
                    continue
                dec = ck.expert_weight(layer, e, proj)[:, :].to(dev)
                ref_bf16 = dequantize(q, torch.bfloat16)
                decoded_mismatch += int(not torch.equal(dec.view(torch.int16),
                                                        ref_bf16.view(torch.int16)))
                decoded += 1
    return {"path": str(ck.path), "layout": ck.layout, "recipe": str(recipe),
            "stored_recipe": str(ck.recipe_of(recs[0].name)), "routed_expert_weights": len(recs),
            "layers": layers, "compared_with_dcp_masters": compared,
            "grid_mismatches": mismatched[:10], "n_grid_mismatches": len(mismatched),
            "decoded_bf16_mismatches": decoded_mismatch, "decoded_compared": decoded,
            "bit_exact": compared > 0 and not mismatched and decoded_mismatch == 0}


# --- fake-quant share --------------------------------------------------------------------

def fq_share(qat: Path, qat_step_s: float | None, reps: int) -> dict:
    import torch

    from workbench.model import preset
    from workbench.qat.grouped import grouped_mm
    from workbench.qat.recipe import parse_qat_recipe

    cfg = _json(qat / "config.json")
    mc = preset(ensure_preset(cfg["preset"]))
    world = int(cfg["world_size"])
    r = parse_qat_recipe(cfg["recipe"], cfg.get("profile"))
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    e_loc = mc.num_experts // world
    rows = cfg["batch"] // world * cfg["seq"] * mc.top_k  # routed rows a rank's experts see
    g = torch.Generator(device=dev).manual_seed(0)
    offs = torch.tensor([rows * (i + 1) // e_loc for i in range(e_loc)], dtype=torch.int32,
                        device=dev)

    def timed(inp: int, outp: int, quant: bool) -> float:
        w = (torch.randn(e_loc, outp, inp, generator=g, device=dev) * mc.init_std).requires_grad_()
        # The trainer runs under bf16 autocast on GPU only (fp32 on CPU); mirror both.
        x = torch.randn(rows, inp, generator=g, device=dev)
        x = (x.bfloat16() if dev.type == "cuda" else x).requires_grad_()
        kw = {"weight": r.weight, "act": r.act} if quant else {}
        ac = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
        times = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            with ac:
                y = grouped_mm(x, w, offs, **kw)
            y.float().sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 2:  # warm-up: Triton compilation, cuBLAS handles
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    from workbench.kernels import grouped as fast

    # What the trainer hands the seam: fp32 masters, bf16 activations under autocast on GPU.
    x_dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    usable = fast.usable(torch.empty(8, mc.hidden_size, dtype=x_dt, device=dev),
                         torch.empty(1, mc.expert_ffn, mc.hidden_size, device=dev), 8)
    d, f = mc.hidden_size, mc.expert_ffn
    per = {}
    for name, (inp, outp) in {"w1/w3": (d, f), "w2": (f, d)}.items():
        per[name] = {"bf16_ms": 1e3 * timed(inp, outp, False), "qat_ms": 1e3 * timed(inp, outp, True)}
    moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers))
    delta_ms = moe_layers * (2 * (per["w1/w3"]["qat_ms"] - per["w1/w3"]["bf16_ms"])
                             + per["w2"]["qat_ms"] - per["w2"]["bf16_ms"])
    out = {"rows_per_rank": rows, "local_experts": e_loc, "moe_layers": moe_layers, "gemms": per,
           "fake_quant_ms_per_step": delta_ms, "device": str(dev), "reps": reps,
           "grouped_mm_cuda_fast_path_with_fp32_masters": usable}
    if qat_step_s:
        out["share_of_qat_step"] = delta_ms / 1e3 / qat_step_s
    return out


# --- budgets -----------------------------------------------------------------------------

def budgets(work: Path) -> dict:
    from workbench.track.compare import compare, load_run_folder

    c = compare([load_run_folder(work / "bf16"), load_run_folder(work / "qat")])
    rows = []
    for row in c.budgets.itertuples(index=False):
        passed = None if row.passed is None or (isinstance(row.passed, float)
                                                and math.isnan(row.passed)) else row.passed
        try:
            passed = None if passed is None else bool(passed)
        except TypeError:  # pandas NA
            passed = None
        rows.append({"run": row.run, "baseline": row.baseline, "budget": row.budget,
                     "measured": float(row.measured), "limit": float(row.limit),
                     "passed": passed, "detail": row.detail})
    return {"table": rows}


# --- summary -----------------------------------------------------------------------------

def _f(x, fmt="{:.4g}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def markdown(s: dict) -> str:
    env = s.get("env") or {}
    machine = (f"machine: {env.get('gpus') or 'CPU'} ({env.get('host')}, {env.get('cpus')} CPUs); "
               f"torch {env.get('torch')} CUDA {env.get('cuda')} NCCL {env.get('nccl', '-')} "
               f"triton {env.get('triton')} transformers {env.get('transformers')} python "
               f"{env.get('python')}; commit {str(env.get('git_commit'))[:12]}")
    header = ("| run | recipe | steps | first loss | final loss | final val | median step s | "
              "tokens/s/GPU | peak GPU GiB (rank 0) |")
    world = (s.get("run_bf16") or s.get("run_qat") or {}).get("world_size", "?")
    lines = [f"## EP{world} protocol summary", "", machine, f"command: `{s.get('command')}`", "", header,
             "|---|---|---|---|---|---|---|---|---|"]
    for name in ("bf16", "qat"):
        r = s.get(f"run_{name}") or {}
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        lines.append(f"| {name} | {r.get('recipe')} | {r.get('last_step')} | {_f(r.get('first_loss'))}"
                     f" | {_f(r.get('final_loss'))} | {_f(r.get('final_val_loss'))} | "
                     f"{_f(r.get('median_step_s'))} | {_f(r.get('median_tokens_per_s_per_gpu'))} | "
                     f"{_f(r.get('peak_mem_gib_rank0'))} |")
    b, q = s.get("run_bf16") or {}, s.get("run_qat") or {}
    if b.get("median_step_s") and q.get("median_step_s"):
        lines.append(f"\nQAT/BF16 step-time ratio: {q['median_step_s'] / b['median_step_s']:.3f}")
    fq = s.get("fake_quant") or {}
    lines.append(f"fake-quant share of QAT step (isolated seam timing): "
                 f"{_f(fq.get('share_of_qat_step'), '{:.1%}')} "
                 f"({_f(fq.get('fake_quant_ms_per_step'))} ms/step){' ' + fq['error'] if 'error' in fq else ''}")
    lp = s.get("load") or {}
    if "ranks" in lp:
        head = ("| --init load, rank | seconds | bytes read | / expected own share | GPU peak GiB | "
                "host RSS GiB before -> after (peak) |")
        lines += ["", head, "|---|---|---|---|---|---|"]
        for r, ratio in zip(lp["ranks"], lp.get("bytes_read_over_expected") or [None] * 8):
            lines.append(f"| {r['rank']} | {_f(r['load_s'])} | {r['bytes_read']} | {_f(ratio)} | "
                         f"{_f(r.get('gpu_peak_gib'))} | {_f(r['host_rss_before_gib'])} -> "
                         f"{_f(r['host_rss_after_gib'])} ({_f(r['host_peak_rss_gib'])}) |")
    else:
        lines.append(f"load probe: {lp.get('error')}")
    rs = s.get("resume") or {}
    lines.append(f"\nSIGKILL at step {rs.get('killed_at_step')}, resumed from step "
                 f"{rs.get('resumed_from_step')}; {rs.get('steps_recomputed')} steps recomputed, "
                 f"max |loss diff| {_f(rs.get('max_abs_loss_diff'))}, bit-exact {rs.get('bit_exact')}; "
                 f"survivors {rs.get('survivors')}{' ' + rs['error'] if 'error' in rs else ''}")
    ex = s.get("export") or {}
    lines.append(f"export: {ex.get('layout')} {ex.get('stored_recipe')}, "
                 f"{ex.get('routed_expert_weights')} routed expert weights; vs DCP masters: "
                 f"{ex.get('n_grid_mismatches')} grid mismatches of "
                 f"{ex.get('compared_with_dcp_masters')}, {ex.get('decoded_bf16_mismatches')} BF16 "
                 f"decode mismatches of {ex.get('decoded_compared')}; bit-exact "
                 f"{ex.get('bit_exact')}{' ' + ex['error'] if 'error' in ex else ''}")
    bt = (s.get("budgets") or {}).get("table")
    if bt:
        lines += ["", "| budget | measured | limit | passed | detail |", "|---|---|---|---|---|"]
        lines += [f"| {r['budget']} | {_f(r['measured'])} | {_f(r['limit'])} | {r['passed']} | "
                  f"{r['detail']} |" for r in bt]
    else:
        lines.append(f"budgets: {(s.get('budgets') or {}).get('error')}")
    lines.append(f"\nbytes on disk: {json.dumps(s.get('sizes'))}")
    lines.append(f"phases (s): {json.dumps(s.get('phases'))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--command", default="")
    p.add_argument("--fq-reps", type=int, default=10)
    p.add_argument("--skip", action="append", default=[], help="parts to leave out")
    a = p.parse_args(argv)
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s: dict = {"command": a.command, "env": _json(work / "env.json"),
               "init": _json(work / "init_stats.json"), "phases": _json(work / "phases.json"),
               "sizes": _json(work / "sizes.json")}
    _part(s, "run_bf16", run_stats, work / "bf16")
    _part(s, "run_qat", run_stats, work / "qat")
    _part(s, "load", load_probe, work)
    _part(s, "resume", resume_check, work / "qat")
    for name, fn, args in (("export", export_check, (work / "qat",)),
                           ("fake_quant", fq_share, (work / "qat", (s["run_qat"] or {}).get(
                               "median_step_s"), a.fq_reps)),
                           ("budgets", budgets, (work,))):
        if name not in a.skip:
            _part(s, name, fn, *args)
    b, q = s["run_bf16"], s["run_qat"]
    if b.get("median_step_s") and q.get("median_step_s"):
        s["qat_over_bf16_step_time"] = q["median_step_s"] / b["median_step_s"]
    _write_json(out / "summary.json", s)
    md = markdown(s)
    (out / "summary.md").write_text(md)
    print(md, flush=True)
    return s


if __name__ == "__main__":
    main()
