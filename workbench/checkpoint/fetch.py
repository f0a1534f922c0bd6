"""Before a run: download the shards one training rank reads, so training never waits on (or
fails with) the network.

`prefetch(spec, experts=range(...))` opens a remote checkpoint by range (the index and every
shard's header: the bytes that say where each tensor lies), works out which shards hold what
the rank reads (every tensor but the routed experts, and of those only ``experts``: the rank's
own under expert parallelism), and downloads those shards and the small files (config,
tokenizer) before returning:

- a hub id goes through ``huggingface_hub.snapshot_download`` into the Hugging Face cache, as
  ``hf download`` would (resumable: an interrupted file continues from its ``.incomplete``
  part; verified by huggingface_hub against the Hub's sizes and hashes; shared by every process
  of the machine through its file locks);
- a URL is downloaded with the range reader into ``$HF_HOME/workbench-downloads/<hash>/``,
  in pieces appended to ``<file>.incomplete`` (a second run continues where the first
  stopped, unless the server's ETag / size changed), checked against the server's size and
  renamed into place under a file lock.

The returned `Source` names the local folder and the remote URL: `open_prefetched` opens it with
network reads of tensor data switched off (`RemoteOptions.fetch_data`), so a read the plan did not
foresee is an error naming the tensor instead of a silent download in the middle of a run.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from workbench._io import atomic_write_bytes, publish
from workbench.source import (
    TOKENIZER_FILES,
    Source,
    hf,
    hf_home,
    hub_cache,
    hub_endpoint,
    remember_ref,
    resolve,
)

from .checkpoint import Checkpoint, open_checkpoint
from .errors import RemoteReadError
from .remote import RemoteFolder, RemoteOptions

SMALL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
               "hf_quant_config.json", *TOKENIZER_FILES)


def rank_tensors(ck: Checkpoint, experts: range | None = None) -> set[str]:
    """Stored tensor names a rank reads: every logical tensor's parts, except routed expert
    weights outside ``experts`` (None: all experts). A fused tensor holding several experts is
    read when any of them is the rank's."""
    routed: dict[str, list[int]] = {}
    for r in ck.experts():
        routed.setdefault(r.name, []).append(r.expert)
    out: set[str] = set()
    for name in ck.logical_names():
        if experts is not None and name in routed and \
                not any(e in experts for e in routed[name]):
            continue
        out.update(stored for _, stored in ck.spec(name).parts)
    return out


def rank_files(ck: Checkpoint, experts: range | None = None) -> list[str]:
    """Names (relative to the checkpoint folder) of the shards holding `rank_tensors`."""
    return sorted({ck.index.relname(ck.index.entry(n).file) for n in rank_tensors(ck, experts)})


def prefetch(spec: str | os.PathLike | Source, *, experts: range | None = None,
             options: RemoteOptions | None = None) -> Source:
    """Download what a rank reads (see the module docstring); a local source is returned as
    it is. Raises a `CheckpointError` subclass (`RemoteReadError` for the network)."""
    src = resolve(spec)
    if src.is_local:
        return src
    opts = options or RemoteOptions()
    ck = Checkpoint(source=src, remote=opts)
    try:
        files = rank_files(ck, experts)
        folder = ck.index.remote
        if src.kind == "hub":
            path = _hub_download(src, files)
        else:
            path = _url_download(folder, files)
    finally:
        ck.close()
    return replace(src, path=path)


def open_prefetched(spec: str | os.PathLike | Source, *, experts: range | None = None,
                    options: RemoteOptions | None = None) -> Checkpoint:
    """`prefetch`, then the checkpoint opened with network reads of tensor data off."""
    src = prefetch(spec, experts=experts, options=options)
    if src.is_local:
        return open_checkpoint(src)
    return open_checkpoint(src, remote=replace(options or RemoteOptions(), fetch_data=False))


def _hub_download(src: Source, files: list[str]) -> Path:
    h = hf()
    try:
        got = h.snapshot_download(src.repo_id, revision=src.revision,
                                  cache_dir=str(hub_cache()), endpoint=hub_endpoint(),
                                  allow_patterns=[*files, *SMALL_FILES])
    except Exception as e:  # huggingface_hub's HTTP and disk errors all mean "not downloaded"
        raise RemoteReadError(f"downloading {len(files)} shard(s) of {src.repo_id} at "
                              f"{src.revision} failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})",
                              path=src.url) from e
    remember_ref(src.repo_id, src.requested, src.revision)
    return Path(got)


def download_folder(url: str) -> Path:
    """Where files of the server folder ``url`` are downloaded to."""
    return hf_home() / "workbench-downloads" / hashlib.sha256(url.encode()).hexdigest()[:20]


def _url_download(folder: RemoteFolder, files: list[str]) -> Path:
    dest = download_folder(folder.root.url)
    dest.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        data = folder.read_small(name, 512 << 20)
        if data is not None:
            atomic_write_bytes(dest / name, data)
    for name in files:
        download(folder, name, dest / name)
    return dest


@contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created), held for the block: ranks of one machine
    downloading the same shard take turns."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def download(folder: RemoteFolder, name: str, dest: Path) -> Path:
    """The remote file ``name`` at ``dest``: resumed from ``dest.incomplete`` when the server
    still has the same file, fetched in pieces (each retried per the folder's policy), its size
    checked, then renamed into place."""
    path = folder.path(name)
    size, _ = folder.open_shard(path)
    ident = folder.identity(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".incomplete")
    meta = dest.with_name(dest.name + ".incomplete.id")
    with _locked(dest.with_name(dest.name + ".lock")):
        if dest.is_file() and dest.stat().st_size == size:
            return dest
        if not meta.is_file() or meta.read_text() != ident:
            part.unlink(missing_ok=True)  # another file now: start over
            atomic_write_bytes(meta, ident.encode())
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            part.unlink()
            have = 0
        piece = folder.options.piece_bytes
        with open(part, "ab") as f:
            for lo in range(have, size, piece):
                hi = min(size, lo + piece)
                f.write(folder.fetch(path, lo, hi))
                f.flush()
            os.fsync(f.fileno())
        got = part.stat().st_size
        if got != size:
            raise RemoteReadError(f"download ended at {got} of {size} bytes", path=path)
        publish(part, dest)
        meta.unlink(missing_ok=True)
    return dest
