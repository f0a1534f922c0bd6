"""The shipped byte-level corpus and deterministic global-batch sampling.

Legend: B global batch (sequences), b = B / W per-rank batch, S sequence length, N corpus bytes.

Corpus: CPython 3.11's top-level standard-library modules (PSF-2.0, licence and manifest with
sha256 next to the data in `corpus/`), tokens are bytes (vocab 256, nothing to download). The
train/validation split is by file and fixed in the manifest.

Tokenized datasets (`--data`, `workbench.train.datasets`) are sampled by whole packed
sequences instead (`PackedSplit`), by the same stateless rule.

Sampling is stateless: the global batch of step s is a function of (seed, s) only, drawn from a
generator seeded by a hash of both, so a resumed run, or a run at another EP size, sees exactly
the same sequences; rank r keeps rows [r*b, (r+1)*b). The "data position" to checkpoint is
therefore just the step.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
CORPUS_FILE = "cpython311_stdlib.txt.xz"
MANIFEST_FILE = "manifest.json"


class CorpusError(RuntimeError):
    """The shipped corpus is missing or does not match its manifest."""


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 [N_train]
    val: torch.Tensor  # uint8 [N_val]
    sha256: str  # of the whole uncompressed corpus (manifest value, verified)
    num_files: int

    def split(self, name: str) -> torch.Tensor:
        if name == "train":
            return self.train
        if name == "val":
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {name!r}")


@lru_cache(maxsize=2)
def load_corpus(directory: str | Path = CORPUS_DIR) -> Corpus:
    """Decompress, verify every file's sha256 against the manifest, and split."""
    directory = Path(directory)
    path, mpath = directory / CORPUS_FILE, directory / MANIFEST_FILE
    for p in (path, mpath):
        if not p.is_file():
            raise CorpusError(f"corpus file {p} is missing (rebuild it with "
                              "python -m workbench.train.corpus.build <cpython lib dir>)")
    manifest = json.loads(mpath.read_text())
    blob = lzma.decompress(path.read_bytes())
    digest = hashlib.sha256(blob).hexdigest()
    if digest != manifest["sha256"] or len(blob) != manifest["total_bytes"]:
        raise CorpusError(f"{path}: sha256 {digest} / {len(blob)} bytes do not match "
                          f"{mpath} ({manifest['sha256']} / {manifest['total_bytes']} bytes)")
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for f in manifest["files"]:
        text = blob[f["offset"]:f["offset"] + f["length"]]
        if hashlib.sha256(text).hexdigest() != f["sha256"]:
            raise CorpusError(f"{path}: file {f['name']} does not match its manifest sha256")
        parts[f["split"]].append(text)
    def cat(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    return Corpus(cat(parts["train"]), cat(parts["val"]), digest, len(manifest["files"]))


def _generator(seed: int, split: str, index: int) -> torch.Generator:
    # A hash, not seed + step: nearby (seed, step) pairs must not give overlapping streams.
    key = hashlib.sha256(f"workbench/{seed}/{split}/{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))


@dataclass(frozen=True)
class PackedSplit:
    """A tokenized dataset split (`workbench.train.datasets`): the token stream cut into
    sequences of S+1 tokens (no padding; only the tail is dropped), of which this split owns
    sequences [first, first + count).

    Sampling (`global_batch`): the global batch of step s holds positions [s*B, (s+1)*B) of an
    endless stream of epochs, each epoch a permutation of the split's sequences drawn from a
    generator keyed by (seed, split, epoch). A pure function of (seed, step), like the byte
    corpus: every EP size sees the same global batch, a resumed run the same sequences."""

    tokens: Any  # numpy uint32 memmap [N] of the whole token file
    seq_len: int  # S + 1
    first: int
    count: int

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ValueError("a PackedSplit needs at least one sequence")

    def numel(self) -> int:
        return self.count * self.seq_len

    def sample(self, *, seed: int, index: int, batch: int, split: str) -> torch.Tensor:
        pos_B = torch.arange(index * batch, (index + 1) * batch)
        rows = torch.empty(batch, dtype=torch.int64)
        for epoch in torch.unique(pos_B // self.count).tolist():
            sel = pos_B // self.count == epoch
            rows[sel] = _permutation(seed, split, epoch, self.count)[pos_B[sel] % self.count]
        starts = (self.first + rows) * self.seq_len
        out = np.stack([self.tokens[s:s + self.seq_len] for s in starts.tolist()])
        return torch.from_numpy(out.astype(np.int64))


@lru_cache(maxsize=8)
def _permutation(seed: int, split: str, epoch: int, count: int) -> torch.Tensor:
    return torch.randperm(count, generator=_generator(seed, f"{split}/epoch", epoch))


def global_batch(tokens_N, *, seed: int, index: int, batch: int, seq: int,
                 split: str = "train") -> torch.Tensor:
    """int64 [B, S+1] rows of the split; `index` is the step (train) or the val batch number.
    A byte tensor gives random windows; a PackedSplit its packed sequences (see there)."""
    if isinstance(tokens_N, PackedSplit):
        if tokens_N.seq_len != seq + 1:
            raise ValueError(f"the {split} split is cut into sequences of {tokens_N.seq_len} "
                             f"tokens, the batch asks for {seq + 1}")
        return tokens_N.sample(seed=seed, index=index, batch=batch, split=split)
    n = tokens_N.numel()
    if n < seq + 2:
        raise ValueError(f"the {split} split has {n} tokens, fewer than one sequence of {seq + 1}")
    start_B = torch.randint(0, n - seq - 1, (batch,), generator=_generator(seed, split, index))
    idx_BS = start_B[:, None] + torch.arange(seq + 1)
    return tokens_N[idx_BS].long()


def rank_slice(batch_BS: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    B = batch_BS.shape[0]
    if B % world:
        raise ValueError(f"global batch {B} is not a multiple of the world size {world}")
    b = B // world
    return batch_BS[rank * b:(rank + 1) * b]
