"""A Hugging Face hub cache built by hand, as huggingface_hub lays it out (its cache docs):
``<HF_HOME>/hub/models--ORG--NAME/blobs/<sha256>`` holding each file once,
``snapshots/<commit>/<file>`` relative symlinks into ``../../blobs/``, and ``refs/<branch>``
holding the commit a branch or tag points at."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def repo_folder(home: Path, repo_id: str) -> Path:
    return Path(home) / "hub" / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(home: Path, repo_id: str, folder: Path, commit: str,
                 refs: tuple[str, ...] = ("main",), skip: tuple[str, ...] = ()) -> Path:
    """Put every file of ``folder`` (except ``skip``) into the cache as snapshot ``commit`` of
    ``repo_id``; each name in ``refs`` points at it. Returns the snapshot folder."""
    assert len(commit) == 40
    repo = repo_folder(home, repo_id)
    blobs, snap = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(folder).rglob("*")):
        rel = f.relative_to(folder)
        if not f.is_file() or str(rel) in skip:
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        if not (blobs / digest).exists():
            shutil.copyfile(f, blobs / digest)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blobs / digest, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def commit_of(n: int) -> str:
    return hashlib.sha1(str(n).encode()).hexdigest()
