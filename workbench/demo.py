"""The embedded default: a small multi-layer MoE checkpoint in a real packed layout, made here.

``demo_checkpoint()`` builds it on first use (minutes on a laptop CPU, then cached):
1. a ``small``-preset model whose routed experts are given the structure real experts show —
   heavy tails that differ by expert, outlier input channels, a few badly conditioned experts —
   written as a BF16 Hugging Face checkpoint (``init/``, the model before QAT), with a tokenizer
   trained here on the shipped corpus saved next to the weights;
2. a short MXFP4 QAT run of the workbench trainer from that checkpoint on the shipped corpus
   (through ``--data``/``--val-data`` and that tokenizer, the path a real model takes),
   exported as BF16 (``run/export/``: the trained masters, the analysis reference), so
   "stored vs reference" measures quantization only, not the drift of training;
3. the same trained model packed as compressed-tensors MXFP4 (``run/export-mxfp4/``), by the
   call the trainer's ``--export compressed-tensors`` makes: the same bytes it would write.

The folder is anchored to the repository (``runs/demo`` next to ``pyproject.toml``) when that
is writable, else to the user cache (``~/.cache/workbench/demo``), never to the working folder
of whoever calls it: a JupyterLab kernel started in ``notebooks/`` finds the same demo.
``WORKBENCH_DEMO_DIR`` overrides it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench._io import atomic_write_bytes, atomic_write_json

__all__ = ["DemoCheckpoint", "default_root", "demo_checkpoint", "runs_dir"]

PRESET = "small"
REPO = Path(__file__).resolve().parents[1]


def runs_dir() -> Path:
    """Where the demo and the notebooks' default outputs live: ``REPO/runs`` in a writable
    source checkout, else ``~/.cache/workbench`` (an installed package has no repository)."""
    if (REPO / "pyproject.toml").is_file() and os.access(REPO, os.W_OK):
        return REPO / "runs"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "workbench"


def default_root() -> Path:
    env = os.environ.get("WORKBENCH_DEMO_DIR")
    return Path(env).expanduser().resolve() if env else runs_dir() / "demo"


@dataclass(frozen=True)
class DemoCheckpoint:
    root: Path
    init: Path  # BF16 checkpoint the QAT run started from (before training)
    run: Path  # trainer run folder (metrics.jsonl, DCP checkpoints)
    packed: Path  # compressed-tensors MXFP4 of the trained masters
    reference: Path  # the QAT run's BF16 export: the trained masters the packed grid encodes


@torch.no_grad()
def structure_experts(model: torch.nn.Module, seed: int = 0) -> None:
    """Give routed experts real-looking structure, keeping each expert's overall std."""
    from workbench.model import GroupedExperts

    g = torch.Generator().manual_seed(seed)
    for li, mod in enumerate(m for m in model.modules() if isinstance(m, GroupedExperts)):
        for name in ("w1", "w3", "w2"):
            w = getattr(mod, name)
            E, O, I = w.shape
            for e in range(E):
                x = w[e].float()
                std = x.std()
                tail = float(torch.rand((), generator=g)) * 1.2  # 0: Gaussian, 1.2: very heavy
                x = x * torch.rand(O, I, generator=g).clamp_min(1e-3).pow(-0.35 * tail)
                if torch.rand((), generator=g) < 0.35:  # outlier input channels
                    cols = torch.randint(0, I, (max(1, I // 32),), generator=g)
                    x[:, cols] *= 6 + 10 * torch.rand(len(cols), generator=g)
                if (e + 3 * li) % 11 == 5:  # a few badly conditioned experts
                    x = x * torch.logspace(-2, 1, O).unsqueeze(1)
                w[e].copy_((x * (std / x.std())).to(w.dtype))


def _write_init(path: Path, seed: int) -> None:
    from workbench.model import MoEForCausalLM, preset
    from workbench.train.export import export_model

    model = MoEForCausalLM(preset(PRESET), seed=seed)
    structure_experts(model, seed)
    export_model(model, path, fmt="bf16")


def _write_tokenizer_and_text(init: Path, data: Path) -> dict[str, Path]:
    """The same path a real model takes, with nothing downloaded: a tokenizer trained here on the
    shipped corpus, saved next to the weights (character-level BPE, 256 tokens = the small
    preset's embedding), and the corpus' train/val splits as text files for --data/--val-data."""
    from workbench.train.data import load_corpus
    from workbench.train.tokenizer import train_bpe

    corpus = load_corpus()
    data.mkdir(parents=True)
    paths = {}
    for split in ("train", "val"):
        paths[split] = data / f"{split}.txt"
        atomic_write_bytes(paths[split], bytes(corpus.split(split).numpy()))
    text = paths["train"].read_text(encoding="utf-8")
    train_bpe([text[i:i + 10_000] for i in range(0, min(len(text), 2_000_000), 10_000)], init,
              vocab_size=256, byte_level=False)
    return paths


def qat_run(args: list[str], packed: str | os.PathLike) -> dict:
    """The trainer on ``args`` (which ask for ``--export bf16``: the masters rounded to BF16, the
    reference), then the same trained model exported packed to ``packed``, by the same
    ``export_model`` call the trainer's ``--export compressed-tensors`` makes, from the same
    fp32 masters: one run, two exports. Returns the trainer's result with ``packed`` added."""
    from workbench.train import distributed
    from workbench.train.args import config_from_args
    from workbench.train.cli import final_summary
    from workbench.train.export import export_model
    from workbench.train.loop import train

    cfg = config_from_args(args)
    if cfg.export != "bf16":
        raise ValueError("qat_run: pass --export bf16 (the reference); the packed export is added")
    info = distributed.setup()
    try:
        result, model = train(cfg, info, return_model=True)
        export_model(model, packed, fmt="compressed-tensors", recipe=cfg.recipe,
                     profile=cfg.profile, group=info.group)
    finally:
        distributed.teardown(info)
    result["packed"] = str(packed)
    print(final_summary(result, cfg) + f"\n[train]   packed export: {packed}", flush=True)
    return result


def demo_checkpoint(root: str | os.PathLike | None = None, *, steps: int = 24, seed: int = 0,
                    force: bool = False) -> DemoCheckpoint:
    """Build (once) and return the embedded default checkpoint."""
    root = Path(root).resolve() if root is not None else default_root()
    d = DemoCheckpoint(root, root / "init", root / "run", root / "run" / "export-mxfp4",
                       root / "run" / "export")
    stamp = root / "demo.json"
    want = {"preset": PRESET, "steps": steps, "seed": seed, "recipe": "mxfp4", "lr": 1e-4,
            "tokenizer": "char-bpe-256", "reference": "bf16-export"}
    if (not force and stamp.exists() and json.loads(stamp.read_text()) == want
            and d.packed.exists() and d.reference.exists()):
        return d
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    print(f"building the demo checkpoint in {root} (once; a few minutes on CPU)")
    _write_init(d.init, seed)
    data = _write_tokenizer_and_text(d.init, root / "data")
    qat_run(["--preset", PRESET, "--recipe", "mxfp4", "--steps", str(steps), "--seed", str(seed),
             "--batch", "8", "--seq", "64", "--lr", "1e-4", "--warmup", "4",
             "--val-every", str(max(1, steps // 3)),
             "--ckpt-every", str(steps), "--init", str(d.init), "--out", str(d.run),
             "--export", "bf16", "--wandb", "disabled",
             "--data", str(data["train"]), "--val-data", str(data["val"])], d.packed)
    atomic_write_json(stamp, want)
    return d
