"""The embedded default: a small multi-layer MoE checkpoint in a real packed layout, made here.

``demo_checkpoint()`` builds it on first use (minutes on a laptop CPU, then cached):
1. a ``small``-preset model whose routed experts are given the structure real experts show —
   heavy tails that differ by expert, outlier input channels, a few badly conditioned experts —
   written as a BF16 Hugging Face checkpoint (``init/``, also the reference for analysis);
2. a short MXFP4 QAT run of the workbench trainer from that checkpoint on the shipped corpus,
   tokenized by a tokenizer trained on it here and saved next to the weights (``init/``);
3. the trainer's compressed-tensors MXFP4 export (``run/export/``): genuinely trained weights.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_ROOT = Path(os.environ.get("WORKBENCH_DEMO_DIR", "runs/demo"))
PRESET = "small"


@dataclass(frozen=True)
class DemoCheckpoint:
    root: Path
    init: Path  # BF16 checkpoint the QAT run started from (reference)
    run: Path  # trainer run folder (metrics.jsonl, DCP checkpoints)
    packed: Path  # compressed-tensors MXFP4 export


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
    from workbench.checkpoint.export import export_model
    from workbench.model import MoEForCausalLM, preset

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
        paths[split].write_bytes(bytes(corpus.split(split).numpy()))
    text = paths["train"].read_text(encoding="utf-8")
    train_bpe([text[i:i + 10_000] for i in range(0, min(len(text), 2_000_000), 10_000)], init,
              vocab_size=256, byte_level=False)
    return paths


def demo_checkpoint(root: str | os.PathLike | None = None, *, steps: int = 24, seed: int = 0,
                    force: bool = False) -> DemoCheckpoint:
    """Build (once) and return the embedded default checkpoint."""
    root = Path(root) if root is not None else DEFAULT_ROOT
    d = DemoCheckpoint(root, root / "init", root / "run", root / "run" / "export")
    stamp = root / "demo.json"
    want = {"preset": PRESET, "steps": steps, "seed": seed, "recipe": "mxfp4", "lr": 1e-4,
            "tokenizer": "char-bpe-256"}
    if not force and stamp.exists() and json.loads(stamp.read_text()) == want and d.packed.exists():
        return d
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    print(f"building the demo checkpoint in {root} (once; a few minutes on CPU)")
    _write_init(d.init, seed)
    data = _write_tokenizer_and_text(d.init, root / "data")
    from workbench.train.cli import main as train

    train(["--preset", PRESET, "--recipe", "mxfp4", "--steps", str(steps), "--seed", str(seed),
           "--batch", "8", "--seq", "64", "--lr", "1e-4", "--warmup", "4",
           "--val-every", str(max(1, steps // 3)),
           "--ckpt-every", str(steps), "--init", str(d.init), "--out", str(d.run),
           "--export", "compressed-tensors", "--wandb", "disabled",
           "--data", str(data["train"]), "--val-data", str(data["val"])])
    stamp.write_text(json.dumps(want))
    return d
