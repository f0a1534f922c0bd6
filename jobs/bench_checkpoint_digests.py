"""What the checkpoint digests cost: `save()` (DCP write + SHA-256 of every file + COMPLETE
marker) against a bare `dcp.save` of the same state, and `verify()` against a plain read of the
same files, in one run.

The trainer's `save()` re-reads the files it just wrote to hash them (page cache warm), and a
resume hashes them once more before loading; both are split across ranks. This job measures
that cost on one process, where it is largest (one rank hashes every file).

    python jobs/bench_checkpoint_digests.py        # qwen3_30b_a3b_like, 1 layer, 8 experts (~4 GB)
    python jobs/bench_checkpoint_digests.py --preset small --repeat 5
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from workbench.model import MoEForCausalLM, preset
from workbench.train import checkpointing as ckpt
from workbench.train.distributed import DistInfo


def _plain_read(folder: Path) -> int:
    n = 0
    for p in sorted(folder.iterdir()):
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                n += len(chunk)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3_30b_a3b_like")
    ap.add_argument("--layers", type=int, default=1, help="num_layers override (presets that take it)")
    ap.add_argument("--experts", type=int, default=8, help="num_experts override (presets that take it)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = ap.parse_args(argv)
    overrides = ({"num_layers": a.layers, "num_experts": a.experts}
                 if a.preset not in ("tiny", "small") else {})
    model = MoEForCausalLM(preset(a.preset, **overrides))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    info = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), group=None,
                    owns_group=False)
    base = Path(tempfile.mkdtemp(prefix="wb-digests-", dir=a.dir))
    rows: dict[str, list[float]] = {"dcp.save (baseline)": [], "save() with digests": [],
                                    "plain read (baseline)": [], "verify()": []}
    nbytes = 0
    try:
        ckpt.ensure_optimizer_state(opt)  # the optimizer state exists before the first timed write, in both arms
        for i in range(a.repeat):
            # alternate which arm goes first: page cache and writeback of the previous arm's
            # files otherwise favour whichever runs second
            for arm in (("bare", "save") if i % 2 == 0 else ("save", "bare")):
                if arm == "bare":
                    bare = base / f"bare{i}"
                    t = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", "torch.distributed is disabled")
                        dcp.save(ckpt.state_dict(model, opt, sched, i, info),
                                 checkpoint_id=str(bare), no_dist=True)
                    rows["dcp.save (baseline)"].append(time.perf_counter() - t)
                    shutil.rmtree(bare)
                    continue
                t = time.perf_counter()
                final = ckpt.save(base / "run", model, opt, sched, i + 1, info, keep=1, meta={})
                rows["save() with digests"].append(time.perf_counter() - t)
                found = ckpt.newest_complete(base / "run")
                for probe in (("read", "verify") if i % 2 == 0 else ("verify", "read")):
                    t = time.perf_counter()
                    if probe == "read":
                        nbytes = _plain_read(final)
                        rows["plain read (baseline)"].append(time.perf_counter() - t)
                    else:
                        assert ckpt.verify(found, info)
                        rows["verify()"].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    print(f"checkpoint digests: preset {a.preset}"
          f"{'' if not overrides else f' ({a.layers} layer, {a.experts} experts)'}, {nbytes / 1e9:.2f} GB per checkpoint, "
          f"median of {a.repeat}; {platform.node()} {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    print(f"{'phase':<24} {'seconds':>8} {'GB/s':>7} {'vs baseline':>12}")
    pairs = {"save() with digests": "dcp.save (baseline)", "verify()": "plain read (baseline)"}
    for k, s in med.items():
        ratio = f"{s / med[pairs[k]]:.2f}x" if k in pairs else ""
        print(f"{k:<24} {s:>8.2f} {nbytes / 1e9 / s:>7.2f} {ratio:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
