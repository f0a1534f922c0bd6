"""Where a checkpoint or tokenizer lives: one resolver for every entry point that names one.

`resolve(spec)` reads a spec, in this order:

1. an existing local path: kind ``local``. A local folder always wins over a hub id of the same
   spelling (``org/tiny`` as a folder under the working directory is that folder);
2. ``hf://ORG/NAME[@REV]`` or ``ORG/NAME[@REV]``: kind ``hub``, resolved through
   ``huggingface_hub``: the local cache first (``HF_HUB_CACHE`` / ``HF_HOME``); when the cache
   lacks what the caller needs and ``HF_HUB_OFFLINE`` is not set, the revision is resolved to its
   commit on the Hub (a token from the usual environment, ``HF_TOKEN`` or ``hf auth login``,
   for gated repos) and the source carries an ``hf://ORG/NAME@COMMIT`` URL for range reads, or
   the few small files asked for are downloaded into the cache. With ``HF_HUB_OFFLINE=1``
   nothing touches the network and a missing id is a `SourceError` saying so in one line;
3. a URL (``https://``, ``http://``, ``s3://``, ...): kind ``url``, read by range;
4. anything else: kind ``local`` with a path that does not exist, which the caller reports.

The result records what it resolved to (`Source.record`, written into runs' ``config.json`` /
``data.json`` and the inspect summary). This module is standard library only (huggingface_hub
is imported where a hub id needs it), so the launcher and the trainer's torch-free config can
call it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench._io import atomic_write_text

KINDS = ("local", "hub", "url")
# What a caller needs on local disk. "checkpoint": any of it may be read by range instead.
NEEDS = ("checkpoint", "config", "tokenizer")
# The files a Hugging Face tokenizer folder may hold (fast or slow, with chat templates).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
URL_SCHEMES = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://", re.IGNORECASE)
# huggingface_hub's own rule (validate_repo_id): [\w.-] names of at most 96 characters, no
# "--" or "..", not starting or ending with "-" or "."
_NAME = r"(?![-.])[\w.-]{1,96}(?<![-.])"
REPO_ID = re.compile(rf"^{_NAME}/{_NAME}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}
_INDEX_CAP = 512 << 20  # as the checkpoint reader's cap on an index


class SourceError(ValueError):
    """A checkpoint or tokenizer spec that cannot be resolved; the message is one line naming
    the spec and what to do."""


@dataclass(frozen=True)
class Source:
    """What a spec resolved to. ``path``: the local folder holding what the caller needs (the
    cache snapshot for a hub id), or None; ``url``: where the rest is read from by range, or
    None when everything is local. ``revision`` is the commit a hub id resolved to;
    ``requested`` the revision as written (None: the default branch)."""

    spec: str
    kind: str
    path: Path | None = None
    url: str | None = None
    repo_id: str | None = None
    revision: str | None = None
    requested: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.path is None and self.url is None:
            raise ValueError("a Source needs a path, a url or both")

    @property
    def is_local(self) -> bool:
        """Every byte is on local disk (no range reads)."""
        return self.url is None

    @property
    def location(self) -> str:
        return str(self.path) if self.is_local else str(self.url)

    def label(self) -> str:
        """Short human name: the repo id and commit for hub sources, else the location."""
        if self.kind == "hub":
            return f"{self.repo_id}@{(self.revision or '?')[:12]}"
        return self.location

    def record(self) -> dict[str, Any]:
        """JSON-able description for run records and summaries."""
        return {"spec": self.spec, "kind": self.kind,
                "path": str(self.path) if self.path is not None else None, "url": self.url,
                "repo_id": self.repo_id, "revision": self.revision,
                "requested_revision": self.requested}

    def describe(self) -> str:
        """One line: what the spec resolved to."""
        if self.kind == "local":
            return f"source: local folder {self.path}"
        if self.kind == "url":
            return f"source: {self.url} (read by range)"
        where = f"cache {self.path}" if self.is_local else f"{self.url} (read by range)"
        asked = f" (asked for {self.requested})" if self.requested else ""
        return f"source: hub {self.repo_id} commit {self.revision}{asked}, {where}"

    def __str__(self) -> str:
        return self.label()


# -- environment, read at call time (huggingface_hub reads these once, at its import) -----------
def is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in _TRUE


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: hub ids come from the cache only."""
    return is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))


def _expand(p: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(p)))


def hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return _expand(os.environ["HF_HOME"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _expand(os.path.join(xdg, "huggingface"))


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub computes it from the environment."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return _expand(os.environ[var])
    return hf_home() / "hub"


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


# -- parsing ------------------------------------------------------------------------------------
def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of ``hf://ORG/NAME[@REV]`` or ``ORG/NAME[@REV]``, else None.
    A revision is a branch, tag or commit (``refs/pr/3`` included)."""
    body = spec.removeprefix("hf://")
    if spec.startswith("hf://") and body.startswith("models/"):
        body = body[len("models/"):]
    repo, at, rev = body.partition("@")
    if not REPO_ID.match(repo) or "--" in repo or ".." in repo:
        return None
    if at:
        if not rev or len(rev) > 256 or ".." in rev or rev.startswith("/") or \
                any(c.isspace() or not c.isprintable() for c in rev):
            raise SourceError(f"{spec!r}: {rev!r} is not a revision (a branch, tag or commit)")
        return repo, rev
    return repo, None


def resolve(spec: str | os.PathLike | Source, *, need: str = "checkpoint") -> Source:
    """The `Source` a checkpoint or tokenizer spec names (see the module docstring).

    ``need`` says what must be on local disk: ``checkpoint`` (nothing: a hub id missing from
    the cache is read by range), ``config`` (config.json, downloaded into the cache when
    missing and online) or ``tokenizer`` (the tokenizer files, likewise)."""
    if isinstance(spec, Source):
        return spec
    if need not in NEEDS:
        raise ValueError(f"need must be one of {NEEDS}, got {need!r}")
    if isinstance(spec, os.PathLike):
        return Source(os.fspath(spec), "local", Path(spec))  # a Path is always a folder
    if not isinstance(spec, str) or not spec or "\x00" in spec:
        raise SourceError(f"{spec!r:.80} is not a folder, hub id or URL")
    if os.path.lexists(spec):
        return Source(spec, "local", Path(spec))
    m = URL_SCHEMES.match(spec)
    if m and m.group("scheme").lower() != "hf":
        if m.group("scheme").lower() == "file":
            return Source(spec, "local", Path(spec[len("file://"):]))
        return Source(spec, "url", url=spec.rstrip("/"))
    hub = parse_hub_id(spec)
    if hub is None:
        if spec.startswith("hf://"):
            raise SourceError(f"{spec!r}: not a hub id (hf://ORG/NAME[@REVISION])")
        return Source(spec, "local", Path(spec))  # the caller says it does not exist
    return _resolve_hub(spec, *hub, need)


# -- hub ids ------------------------------------------------------------------------------------
def hf():
    """huggingface_hub, or a SourceError naming the extra that installs it."""
    try:
        import huggingface_hub
    except ImportError as e:
        raise SourceError("hub ids need huggingface_hub: pip install 'workbench[hub]'") from e
    return huggingface_hub


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cache's snapshot folder of ``repo_id`` at ``revision`` (None: main), never touching
    the network; None when the cache has no such snapshot."""
    h = hf()
    from huggingface_hub.errors import EntryNotFoundError

    try:
        got = h.snapshot_download(repo_id, revision=revision, cache_dir=str(hub_cache()),
                                  local_files_only=True)
    except EntryNotFoundError as e:  # LocalEntryNotFoundError, IncompleteSnapshotError
        # a partial snapshot (some files downloaded) is still where those files are: the
        # caller checks what it needs
        where = getattr(e, "snapshot_path", None)
        return Path(where) if where else None
    except ValueError as e:  # an invalid repo id or revision by huggingface_hub's rules
        raise SourceError(f"{repo_id}: {str(e).splitlines()[0]}") from None
    return Path(got)


def _present(folder: Path, name: str) -> bool:
    # a dangling link (a blob deleted from the cache) is missing, not present
    return (folder / name).is_file()


def missing_files(folder: Path, need: str) -> list[str]:
    """The files ``need`` requires that ``folder`` (a cache snapshot) lacks."""
    if need == "config":
        return [] if _present(folder, "config.json") else ["config.json"]
    if need == "tokenizer":
        return [] if any(_present(folder, n) for n in TOKENIZER_FILES) else \
            ["tokenizer.json or tokenizer_config.json"]
    out = [] if _present(folder, "config.json") else ["config.json"]
    if _present(folder, INDEX_FILE):
        try:
            doc = json.loads((folder / INDEX_FILE).read_bytes()[:_INDEX_CAP])
            shards = sorted({v for v in doc["weight_map"].values() if isinstance(v, str)})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return out  # the reader opens it and reports exactly what is wrong
        out += [s for s in shards if not _present(folder, s)]
    elif not _present(folder, SINGLE_FILE) and not any(folder.glob("*.safetensors")):
        out.append(f"{INDEX_FILE} or {SINGLE_FILE}")
    return out


def _resolve_hub(spec: str, repo_id: str, rev: str | None, need: str) -> Source:
    h = hf()
    snap = cached_snapshot(repo_id, rev)
    missing = missing_files(snap, need) if snap is not None else None
    if snap is not None and not missing:
        return Source(spec, "hub", snap, None, repo_id, snap.name, rev)
    name = f"{repo_id}@{rev}" if rev else repo_id
    if offline() and snap is not None and need == "checkpoint" and _present(snap, "config.json"):
        # a partial snapshot (the shards one rank downloaded, say): its files are read there,
        # the rest only from the range cache, never from the network
        return Source(spec, "hub", snap, f"hf://{repo_id}@{snap.name}", repo_id, snap.name, rev)
    if offline():
        what = "is not in the Hugging Face cache" if snap is None else \
            f"is in the Hugging Face cache without {_few(missing)}"
        raise SourceError(f"{name} {what} ({hub_cache()}) and HF_HUB_OFFLINE=1 allows no "
                          f"download: fetch it first (hf download {repo_id}"
                          f"{' --revision ' + rev if rev else ''}) or unset HF_HUB_OFFLINE")
    commit = resolve_commit(repo_id, rev)
    if need == "checkpoint":
        have = snap if snap is not None and snap.name == commit else None
        return Source(spec, "hub", have, f"hf://{repo_id}@{commit}", repo_id, commit, rev)
    patterns = ["config.json"] if need == "config" else list(TOKENIZER_FILES)
    try:
        got = Path(h.snapshot_download(repo_id, revision=commit, cache_dir=str(hub_cache()),
                                       allow_patterns=patterns, endpoint=hub_endpoint()))
    except Exception as e:  # the HTTP errors of huggingface_hub: all mean "cannot fetch"
        raise SourceError(f"{name}: downloading {need} files failed "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from e
    remember_ref(repo_id, rev, commit)
    left = missing_files(got, need)
    if left:
        raise SourceError(f"{name} (commit {commit}) has no {_few(left)}")
    return Source(spec, "hub", got, None, repo_id, commit, rev)


def remember_ref(repo_id: str, rev: str | None, commit: str) -> None:
    """Record in the cache that ``rev`` (None: main) of ``repo_id`` is ``commit``, as
    huggingface_hub does after resolving a branch (``refs/<rev>`` holding the commit), so the
    id resolves offline later. Downloads go by commit, so every file of one run is of one
    commit even if the branch moves meanwhile."""
    rev = rev or "main"
    if COMMIT.match(rev):
        return
    ref = hub_cache() / ("models--" + repo_id.replace("/", "--")) / "refs" / rev
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(ref, commit)
    except OSError:
        pass  # a read-only cache: the next offline resolution names what is missing


def resolve_commit(repo_id: str, rev: str | None) -> str:
    """The commit ``rev`` (None: the default branch) of ``repo_id`` names, asked of the Hub."""
    if rev is not None and COMMIT.match(rev):
        return rev
    h = hf()
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"{repo_id}@{rev}" if rev else repo_id
    try:
        info = h.HfApi(endpoint=hub_endpoint()).repo_info(repo_id, revision=rev)
    except GatedRepoError:
        raise SourceError(f"{name} is gated: accept its terms on the Hub and set HF_TOKEN "
                          "(or run hf auth login)") from None
    except RepositoryNotFoundError:
        raise SourceError(f"{name}: no such repository on {hub_endpoint()} (or it is private: "
                          "set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise SourceError(f"{name}: the repository has no revision {rev!r}") from None
    except Exception as e:  # connection errors, timeouts, 5xx after huggingface_hub's retries
        raise SourceError(f"{name}: cannot reach {hub_endpoint()} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from e
    if not isinstance(info.sha, str) or not COMMIT.match(info.sha):
        raise SourceError(f"{name}: the Hub answered no commit for this revision")
    return info.sha


def _few(names: list[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")
