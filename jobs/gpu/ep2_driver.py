"""Steps of the two-GPU expert-parallel QAT protocol (`jobs/gpu/ep2_protocol.sh` runs them).

Every step goes through the workbench's own code: the model presets, `export_model` (to write the
packed MXFP4 start checkpoint), the trainer's `workbench.train.cli.main` (under torchrun, NCCL on
GPU and gloo on CPU), the DCP `--init` reader. This file adds only what the protocol measures
around them: per-rank memory while `--init` loads, and a SIGKILL of a running job.

    python jobs/gpu/ep2_driver.py env
    python jobs/gpu/ep2_driver.py write-init --preset P --out DIR
    torchrun --nproc-per-node 2 jobs/gpu/ep2_driver.py train [--probe-load] -- <trainer flags>
    python jobs/gpu/ep2_driver.py kill-at --out DIR --step K -- <command that runs the trainer>

Preset names of the form `BASE-L<layers>-V<vocab>` (e.g. `qwen3_30b_a3b_like-L2-V256`) are
registered on the fly as `BASE` with that many layers and that vocabulary, so the protocol keeps a
real model's expert shapes while fitting a short device lease (the corpus is byte-level, so a
vocabulary of 256 loses nothing but lm_head time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_VARIANT = re.compile(r"^(?P<base>[A-Za-z0-9_]+)-L(?P<layers>\d+)-V(?P<vocab>\d+)$")
GIB = 2**30


def ensure_preset(name: str) -> str:
    """Register `BASE-L<n>-V<v>` in the model preset table (a plain dict) when it is not there."""
    from workbench import arch as mc

    if name in mc.PRESETS:
        return name
    m = _VARIANT.match(name)
    if m is None or m["base"] not in mc.PRESETS:
        raise ValueError(f"preset {name!r} is neither a model preset ({sorted(mc.PRESETS)}) nor "
                         "BASE-L<layers>-V<vocab> over one")
    base, layers, vocab = mc.PRESETS[m["base"]], int(m["layers"]), int(m["vocab"])

    def variant(**overrides):
        return base(**{"num_layers": layers, "vocab_size": vocab, **overrides})

    variant.__doc__ = f"{m['base']} with {layers} layers and vocabulary {vocab} (ep2 protocol)"
    return mc.register_preset(name, variant)


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _write_json(path: Path, obj) -> None:
    from workbench._io import atomic_write_json  # REPO joins sys.path above, at run time

    atomic_write_json(path, obj, default=str)


# --- env ---------------------------------------------------------------------------------

def cmd_env(args) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "host": platform.node(), "cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    for mod in ("triton", "safetensors", "transformers", "numpy", "pandas"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - an absent or broken package is a fact to report
            info[mod] = f"absent ({type(e).__name__})"
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpu_mem_gib"] = [round(torch.cuda.get_device_properties(i).total_memory / GIB, 1)
                               for i in range(torch.cuda.device_count())]
    # the device tool copies the working tree without .git: the caller may name the commit
    info["git_commit"] = os.environ.get("WORKBENCH_COMMIT", "")
    if not info["git_commit"]:
        try:
            info["git_commit"] = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, text=True, capture_output=True,
                timeout=10, check=False).stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            info["git_commit"] = "unknown"
    if args.out:
        _write_json(Path(args.out), info)
    print("[ep2] env " + json.dumps(info), flush=True)
    return info


# --- write-init --------------------------------------------------------------------------

def _random_model(name: str, seed: int, dev, group=None, *, fill: bool = True):
    """The preset's model with N(0, init_std) weights drawn on `dev` (norm gains 1). Not the
    model's own `reset_parameters`, which draws every expert on the CPU (about 10 s per billion
    parameters there): this start checkpoint only needs real shapes and realistic magnitudes."""
    import torch

    from workbench.model import MoEForCausalLM, preset
    from workbench.model.layers import RMSNorm

    mcfg = preset(name)
    model = MoEForCausalLM(mcfg, seed=seed, ep_group=group, device="meta", dtype=torch.float32)
    model.to_empty(device=dev)  # buffers (RoPE) stay unset: this model is exported, never run
    if not fill:
        return model
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            for p in mod.parameters(recurse=False):
                if isinstance(mod, RMSNorm):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, mcfg.init_std, generator=gen)
    return model


def cmd_write_init(args) -> dict:
    """A packed compressed-tensors MXFP4 checkpoint of a random model of the preset."""
    import torch

    from workbench.train.export import export_model

    if args.env:
        cmd_env(argparse.Namespace(out=args.env))
    name = ensure_preset(args.preset)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    t0 = time.perf_counter()
    model = _random_model(name, args.seed, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t1 = time.perf_counter()
    path = export_model(model, args.out, fmt="compressed-tensors", recipe="mxfp4")
    t2 = time.perf_counter()
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    from safetensors import safe_open

    expert_bytes = dense_bytes = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(Path(path) / shard), "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a dict
                sl = f.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                nbytes = n * {"U8": 1, "BF16": 2, "F32": 4, "F8_E4M3": 1}.get(sl.get_dtype(), 4)
                if ".mlp.experts." in k:
                    expert_bytes += nbytes
                else:
                    dense_bytes += nbytes
    stats = {"path": str(path), "preset": name, "seed": args.seed, "device": str(dev),
             "build_s": t1 - t0, "export_s": t2 - t1, "expert_bytes": expert_bytes,
             "dense_bytes": dense_bytes, "params": sum(p.numel() for p in model.parameters())}
    _write_json(Path(args.out).parent / "init_stats.json", stats)
    print("[ep2] init " + json.dumps(stats), flush=True)
    return stats


# --- train -------------------------------------------------------------------------------

def _probe_load(argv: list[str], info) -> None:
    """Collective: build this rank's model, then time `--init` alone and record its memory."""
    import torch
    import torch.distributed as dist

    from workbench.train import distributed
    from workbench.train.args import config_from_args
    from workbench.train.init import load_init

    cfg = config_from_args(argv)
    if not cfg.init:
        raise SystemExit("--probe-load needs --init in the trainer flags")
    cuda = info.device.type == "cuda"
    # This rank's parameter storage as the trainer allocates it (fp32, local experts), left
    # uninitialised: --init overwrites every parameter (the trainer's build_model would first
    # draw its own initialisation on the CPU, seconds per billion parameters).
    model = _random_model(cfg.preset, cfg.seed, info.device, info.group, fill=False)
    if cuda:
        torch.cuda.synchronize(info.device)
        torch.cuda.reset_peak_memory_stats(info.device)
    rec = {"rank": info.rank, "world": info.world, "host_rss_before_gib": _rss_gib(),
           "host_peak_rss_before_gib": _peak_rss_gib(),
           "gpu_alloc_before_gib": torch.cuda.memory_allocated(info.device) / GIB if cuda else None}
    distributed.barrier(info)
    t0 = time.perf_counter()
    stats = load_init(cfg.init, model, info)
    if cuda:
        torch.cuda.synchronize(info.device)
    rec.update(load_s=time.perf_counter() - t0, bytes_read=stats["bytes_read"],
               items_read=stats["items_read"], host_rss_after_gib=_rss_gib(),
               host_peak_rss_gib=_peak_rss_gib(),
               gpu_peak_gib=torch.cuda.max_memory_allocated(info.device) / GIB if cuda else None,
               gpu_reserved_peak_gib=(torch.cuda.max_memory_reserved(info.device) / GIB
                                      if cuda else None),
               expert_params_local=sum(p.numel() for n, p in model.named_parameters()
                                       if ".experts." in n))
    recs = [rec]
    if info.group is not None:
        recs = [None] * info.world
        dist.all_gather_object(recs, rec, group=info.group)
    if info.is_main:
        # beside the run folder, not in it: a run folder holds only what the trainer writes
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_json(out.parent / f"{out.name}.load_probe.json", recs)
        for r in recs:
            print("[ep2] load " + json.dumps(r), flush=True)
    del model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(info.device)


def cmd_train(args) -> dict:
    from workbench.train import distributed
    from workbench.train.cli import main

    argv = list(args.trainer)
    if "--preset" in argv:
        ensure_preset(argv[argv.index("--preset") + 1])
    info = distributed.setup()  # main() reuses this group
    try:
        if args.probe_load:
            _probe_load(argv, info)
        return main(argv)
    finally:
        distributed.teardown(info)


# --- kill-at -----------------------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # comm may hold spaces or ')'
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant alive now (torchrun starts its workers in new sessions, so a
    process-group kill would miss them)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _last_step(out: Path) -> int:
    from workbench.track.metrics import read_metrics

    df = read_metrics(out, missing_ok=True)
    return int(df["step"].iloc[-1]) if len(df) else 0


def cmd_kill_at(args) -> dict:
    """Run the command, SIGKILL its whole process tree once metrics reach `--step` and a
    complete checkpoint exists, and record what was left on disk."""
    from workbench.train.checkpointing import list_complete

    out = Path(args.out)
    # what the protocol keeps of the kill lies beside the run folder, never in it: a
    # run folder holds only what the trainer writes, and its resume refuses anything else
    def beside(name: str) -> Path:
        return out.with_name(f"{out.name}.{name}")

    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(beside("killed_run.log"), "w")  # noqa: SIM115 - handed to the child

    def _terminated(signum, frame):  # `timeout` stops us: the finally below reaps the tree
        raise SystemExit(f"kill-at: stopped by signal {signum}")

    old_handler = signal.signal(signal.SIGTERM, _terminated)
    t0 = time.monotonic()
    proc = subprocess.Popen(args.command, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    rec: dict = {"command": args.command, "kill_step": args.step}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"kill-at: the run ended (rc {proc.returncode}) before step "
                                 f"{args.step}; see {beside('killed_run.log')}")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"kill-at: step {args.step} not reached in {args.timeout} s")
            if _last_step(out) >= args.step and list_complete(out):
                break
            time.sleep(0.05)
        tree = process_tree(proc.pid)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        rec.update(killed_pids=tree, survivors=[p for p in tree if _alive(p)],
                   rc=proc.returncode, wall_s=time.monotonic() - t0,
                   last_metrics_step=_last_step(out),
                   complete_checkpoints=[f.step for f in list_complete(out)],
                   partial_checkpoints=sorted(p.name for p in (out / "checkpoints").glob(".tmp-*")))
    finally:
        if proc.poll() is None:  # any failure above: leave nothing running
            for pid in process_tree(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        log.close()
        signal.signal(signal.SIGTERM, old_handler)
    if (out / "metrics.jsonl").is_file():
        # --resume truncates metrics.jsonl; keep the pre-kill steps to compare with the rerun.
        shutil.copyfile(out / "metrics.jsonl", beside("metrics_before_kill.jsonl"))
    _write_json(beside("kill.json"), rec)
    print("[ep2] kill " + json.dumps(rec), flush=True)
    if rec["survivors"]:
        raise SystemExit(f"kill-at: processes {rec['survivors']} survived SIGKILL")
    return rec


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--out")
    w = sub.add_parser("write-init")
    w.add_argument("--preset", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--env", help="also write the env record (versions, GPUs) to this JSON file")
    t = sub.add_parser("train")
    t.add_argument("--probe-load", action="store_true")
    t.add_argument("trainer", nargs=argparse.REMAINDER)
    k = sub.add_parser("kill-at")
    k.add_argument("--out", required=True)
    k.add_argument("--step", type=int, required=True)
    k.add_argument("--timeout", type=float, default=600)
    k.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    for name in ("trainer", "command"):
        if getattr(a, name, None) and getattr(a, name)[0] == "--":
            setattr(a, name, getattr(a, name)[1:])
    fn = {"env": cmd_env, "write-init": cmd_write_init, "train": cmd_train,
          "kill-at": cmd_kill_at}[a.cmd]
    return fn(a)


if __name__ == "__main__":
    main()
