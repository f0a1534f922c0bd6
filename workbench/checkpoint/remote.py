"""A checkpoint folder on a server: the files of ``hf://ORG/NAME@COMMIT``, ``https://...`` or
any fsspec URL (``s3://`` with s3fs installed), read by byte range.

`RemoteFolder` gives the lazy index (`index.ShardIndex`) what a local folder gives it: small
JSON files whole, a shard's size, and byte ranges, so the header checks and the tensor reads
of local and remote checkpoints are the same code. Each range:

1. comes from the `RangeCache` when an intact entry exists (keyed by the file's identity, so a
   moved branch or an edited file never serves old bytes: hub files are named by commit, other
   servers' files by their ETag / Last-Modified and size, learnt from the first 8 bytes of
   each shard, which are always fetched);
2. else is fetched in pieces of at most ``PIECE`` bytes, each retried with exponential backoff
   on transient errors (`RetryPolicy`: 408/429/5xx, a dropped connection, a body cut short),
   within a bounded total time, and used only when complete and of the asked length;
3. is counted in `FetchStats` and on a tqdm bar of bytes fetched.

Names from an index must be plain relative file names (no ``..``, no absolute path, no URL), the
rule local folders follow, so a remote index cannot send the reader to another repository or
host.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.source import Source, hf, hub_endpoint, offline

from .errors import ConfigError, MissingFileError, RemoteReadError, UnsafePathError
from .http import FetchError, HttpClient, NotFound, Permanent, Reply, Transient
from .range_cache import RangeCache
from .safe_io import checkpoint_root, parse_json, read_capped

PIECE = 32 << 20  # bytes per request: bounds memory per request and the work a retry repeats


@dataclass(frozen=True)
class RetryPolicy:
    """How a failed request is retried: at most ``attempts`` tries, waiting
    ``first_wait_s * 2**k`` (capped at ``max_wait_s``, or the server's Retry-After) between
    them, and never past ``deadline_s`` from the first try."""

    attempts: int = 6
    first_wait_s: float = 0.5
    max_wait_s: float = 8.0
    deadline_s: float = 120.0
    timeout_s: float = 60.0  # one request's socket timeout

    def __post_init__(self):
        if self.attempts < 1 or min(self.first_wait_s, self.max_wait_s, self.deadline_s) < 0 \
                or self.timeout_s <= 0:
            raise ValueError(f"attempts >= 1, waits >= 0 and timeout_s > 0, got {self}")


@dataclass(frozen=True)
class RemoteOptions:
    """How remote checkpoints are read: the range cache (``"default"``: `RangeCache.default`,
    None: no cache), retries, whether a progress bar shows the bytes fetched, and whether
    tensor data may come over the network at all (``fetch_data=False``: only headers and small
    files may; a trainer sets it once its shards are downloaded, so a read it did not plan for
    is an error rather than a network dependency in the middle of a run)."""

    cache: RangeCache | str | None = "default"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    progress: bool = True
    fetch_data: bool = True
    piece_bytes: int = PIECE  # bytes per request

    def __post_init__(self):
        if self.piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {self.piece_bytes}")

    def range_cache(self) -> RangeCache | None:
        if self.cache == "default":
            return RangeCache.default()
        if self.cache is not None and not isinstance(self.cache, RangeCache):
            raise ValueError(f"cache must be a RangeCache, 'default' or None, got {self.cache!r}")
        return self.cache


@dataclass
class FetchStats:
    """What a remote folder read: bytes over the network (``fetched``, in ``requests`` GETs,
    ``retries`` of them repeats) and bytes served from the range cache (``cached``)."""

    fetched: int = 0
    requests: int = 0
    retries: int = 0
    cached: int = 0
    cache_hits: int = 0


class RemotePath:
    """The URL of one remote file; quacks like the ``Path`` of a local one where the reader
    uses it (``name``, ``parent``, ``/``, ``str``), and is a dictionary key."""

    __slots__ = ("url",)

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}")

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:  # DCP compares checkpoint ids with os.fspath
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(("remote", self.url))


def check_name(name: Any, *, source, tensor: str | None = None) -> str:
    """A file name from a remote index, refused unless a plain relative name inside the folder."""
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 1024:
        raise UnsafePathError(f"invalid shard name {name!r:.80}", path=source, tensor=tensor)
    parts = name.split("/")
    if name.startswith(("/", "\\")) or "\\" in name or "://" in name or ":" in parts[0] or \
            any(p in ("", ".", "..") for p in parts) or "%" in name or "?" in name or "#" in name:
        raise UnsafePathError(f"shard name {name!r:.80} is not a file inside the repository "
                              "(absolute, a URL, or climbing out)", path=source, tensor=tensor)
    return name


# -- transports: how bytes come from one kind of server ------------------------------------------
class _Http:
    """http(s) and the Hub's resolve URLs."""

    def __init__(self, base: str, headers: dict[str, str], timeout_s: float,
                 lister: Callable[[], list[str]] | None = None):
        self.base, self.client, self.lister = base.rstrip("/"), HttpClient(headers,
                                                                           timeout_s=timeout_s), lister

    def url(self, name: str) -> str:
        return f"{self.base}/{urllib.parse.quote(name)}"

    def get(self, name: str, begin: int | None, end: int | None, cap: int | None) -> Reply:
        return self.client.get(self.url(name), begin, end, cap=cap)

    def list(self) -> list[str] | None:
        return self.lister() if self.lister is not None else None

    def close(self) -> None:
        self.client.close()


class _Fsspec:
    """Any fsspec file system (s3://, gs://, memory://, ...)."""

    def __init__(self, url: str):
        try:
            import fsspec
        except ImportError as e:
            raise ImportError("remote URLs need fsspec: pip install 'workbench[hub]'") from e
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:  # an unknown protocol, or its package missing
            raise MissingFileError(f"cannot read this URL: {e}", path=url) from None
        self.root = self.root.rstrip("/")
        self._sizes: dict[str, tuple[int, str | None]] = {}

    def url(self, name: str) -> str:
        return f"{self.fs.unstrip_protocol(self.root)}/{name}"

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except FileNotFoundError as e:
            raise NotFound(f"no such file ({e})") from None
        except PermissionError as e:
            raise Permanent(f"access denied ({e})") from None
        except (ConnectionError, TimeoutError) as e:
            raise Transient(f"{type(e).__name__}: {e}") from e
        except OSError as e:
            status = getattr(e, "status", None) or getattr(e, "code", None)
            if isinstance(status, int) and (status >= 500 or status == 429):
                raise Transient(f"{type(e).__name__}: {e}") from e
            raise Permanent(f"{type(e).__name__}: {e}") from e

    def get(self, name: str, begin: int | None, end: int | None, cap: int | None) -> Reply:
        path = f"{self.root}/{name}"
        if name not in self._sizes:
            info = self._call(self.fs.info, path)
            size = info.get("size")
            if not isinstance(size, int):
                raise Permanent("the file system gives no size for this file")
            tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("created")
            self._sizes[name] = (size, None if tag is None else str(tag))
        size, tag = self._sizes[name]
        if begin is None:
            if cap is not None and size > cap:
                raise Permanent(f"file is {size} bytes, over the {cap}-byte limit")
            begin, end = 0, size
        if end > size:
            raise Permanent(f"range [{begin}, {end}) is not inside the {size}-byte file")
        data = self._call(self.fs.cat_file, path, start=begin, end=end)
        if len(data) != end - begin:
            raise Transient(f"short read: {len(data)} of {end - begin} bytes arrived")
        return Reply(bytes(data), size, tag)

    def list(self) -> list[str] | None:
        found = self._call(self.fs.ls, self.root, detail=False)
        return [p.rsplit("/", 1)[-1] for p in found]

    def close(self) -> None:
        pass


def _hub_transport(src: Source, timeout_s: float) -> _Http:
    h = hf()
    from huggingface_hub.utils import build_hf_headers

    repo, commit = src.repo_id, src.revision
    headers = build_hf_headers()  # the token from HF_TOKEN or `hf auth login`, if any

    def lister() -> list[str]:
        return h.HfApi(endpoint=hub_endpoint()).list_repo_files(repo, revision=commit)

    return _Http(f"{hub_endpoint()}/{repo}/resolve/{commit}", headers, timeout_s, lister)


# -- the folder ---------------------------------------------------------------------------------
class RemoteFolder:
    """The files of a remote checkpoint folder (see the module docstring)."""

    is_local = False

    def __init__(self, source: Source, options: RemoteOptions | None = None):
        if source.url is None:
            raise ValueError(f"{source.spec}: a RemoteFolder needs a URL source")
        self.source = source
        self.options = options or RemoteOptions()
        self.retry = self.options.retry
        self.cache = self.options.range_cache()
        self.stats = FetchStats()
        url = source.url
        # a hub id under HF_HUB_OFFLINE: local files and the range cache only
        self.offline = source.kind == "hub" and offline()
        if source.kind == "hub":
            self.transport = _hub_transport(source, self.retry.timeout_s)
            self.immutable = True  # named by commit: a range's bytes never change
        elif urllib.parse.urlsplit(url).scheme.lower() in ("http", "https"):
            self.transport = _Http(url, {}, self.retry.timeout_s)
            self.immutable = False
        else:
            self.transport = _Fsspec(url)
            self.immutable = False
        self.root = RemotePath(url)
        # files already on local disk (a partial cache snapshot, a download folder): read there
        self.local = Path(source.path) if source.path is not None else None
        self.local_root = checkpoint_root(self.local) if self.local is not None else None
        self._lock = threading.Lock()
        self._ident: dict[str, str] = {}  # file name -> identity for cache keys
        # file name -> (size, ETag or Last-Modified) seen at open: a later reply of another
        # version is refused, so one tensor never mixes the bytes of two versions of a file
        self._version: dict[str, tuple[int, str | None]] = {}
        self._bar = None

    @property
    def location(self) -> str:
        return self.root.url

    def path(self, name: str, *, source=None, tensor: str | None = None) -> RemotePath:
        return self.root / check_name(name, source=source or self.root, tensor=tensor)

    def _name(self, path: RemotePath) -> str:
        if not isinstance(path, RemotePath) or not path.url.startswith(self.root.url + "/"):
            raise ValueError(f"{path!r} is not a file of {self.root}")
        return path.url[len(self.root.url) + 1:]

    def local_file(self, name: str) -> Path | None:
        """``name`` in the local folder, when it is a file there (a dangling cache link is
        not)."""
        if self.local is None:
            return None
        p = self.local / name
        return p if p.is_file() else None

    # -- whole small files ----------------------------------------------------------------------
    def read_small(self, name: str, cap: int, *, what: str = "file") -> bytes | None:
        """All bytes of ``name`` (at most ``cap``), or None when the server has no such file;
        from the local folder when it holds the file."""
        path = self.path(name)
        local = self.local_file(name)
        if local is not None:
            return read_capped(local, self.local_root, cap, what=what)
        key = f"{path.url}|whole" if self.immutable else None
        if key is not None and self.cache is not None:
            data = self.cache.get(key)
            if data is not None and len(data) <= cap:
                self._count_cached(len(data))
                return data
        if self.offline:
            return None  # offline, a file the snapshot lacks counts as absent
        try:
            reply = self._fetch(path, None, None, cap=cap, tensor=None)
        except RemoteReadError as e:
            if isinstance(e.__cause__, NotFound):
                return None
            if isinstance(e.__cause__, Permanent) and "limit" in str(e.__cause__):
                raise ConfigError(f"{what} is over the {cap}-byte limit", path=path) from None
            raise
        if key is not None and self.cache is not None:
            self.cache.put(key, reply.data)
        return reply.data

    def read_json(self, name: str, cap: int, *, what: str = "file") -> tuple[Any, bool]:
        """(parsed JSON, True) of ``name``, or (None, False) when absent; ConfigError when not
        JSON."""
        raw = self.read_small(name, cap, what=what)
        if raw is None:
            return None, False
        return parse_json(raw, self.path(name)), True

    def list_names(self) -> list[str] | None:
        """Names of the folder's files, or None when the server cannot list (plain https)."""
        names = self._retrying(lambda: self.transport.list(), self.root, None, "the listing")
        return None if names is None else sorted(names)

    # -- shards ---------------------------------------------------------------------------------
    def _cached_size(self, path: RemotePath) -> int | None:
        raw = self.cache.get(f"{path.url}|size") if self.cache is not None else None
        return int(raw) if raw and raw.isdigit() else None

    def open_shard(self, path: RemotePath, tensor: str | None = None) -> tuple[int, bytes]:
        """(file size, first 8 bytes) of a shard; fixes the identity its ranges are cached
        under. Raises MissingFileError when the server has no such file."""
        if self.immutable and self.cache is not None:
            size = self._cached_size(path)
            if size is not None:
                head = self.cache.get(f"{path.url}|0|8", min(8, size))
                if head is not None:
                    self._count_cached(len(head))
                    with self._lock:
                        self._ident[path.url] = path.url
                    return size, head
        n = 8
        try:
            reply = self._fetch(path, 0, n, tensor=tensor)
        except RemoteReadError as e:
            if isinstance(e.__cause__, NotFound):
                raise MissingFileError("the server has no such shard", path=path,
                                       tensor=tensor) from None
            if isinstance(e.__cause__, Permanent) and "416" in str(e.__cause__):
                raise RemoteReadError("the file is shorter than a safetensors header "
                                      "(8 bytes)", path=path, tensor=tensor) from None
            raise
        if reply.total is None:
            raise RemoteReadError("the server does not say the file's size (Content-Range "
                                  "bytes B-E/*)", path=path, tensor=tensor)
        ident = path.url if self.immutable else f"{path.url}|{reply.total}|{reply.validator}"
        with self._lock:
            self._ident[path.url] = ident
            self._version[path.url] = (reply.total, reply.validator)
        if self.immutable and self.cache is not None:
            self.cache.put(f"{path.url}|size", str(reply.total).encode())
            self.cache.put(f"{path.url}|0|8", reply.data)
        return reply.total, reply.data

    def pread(self, path: RemotePath, buf: memoryview, offset: int,
              tensor: str | None = None, *, data: bool = True) -> None:
        """Fill ``buf`` with the bytes of ``path`` from ``offset``: from the cache where it
        holds them, else fetched in pieces of at most ``piece_bytes``. ``data`` False marks a
        header read (allowed when `RemoteOptions.fetch_data` is off)."""
        n = len(buf)
        with self._lock:
            ident = self._ident.get(path.url)
        if ident is None:
            raise RuntimeError(f"{path}: open_shard first")
        if data and not self.options.fetch_data:
            raise RemoteReadError("this tensor's shard was not downloaded before the run and "
                                  "network reads of tensor data are off (fetch_data=False)",
                                  path=path, tensor=tensor)
        piece = self.options.piece_bytes
        for lo in range(0, n, piece):
            hi = min(n, lo + piece)
            b, e = offset + lo, offset + hi
            key = f"{ident}|{b}|{e}"
            chunk = self.cache.get(key, e - b) if self.cache is not None else None
            if chunk is not None:
                self._count_cached(len(chunk))
            else:
                chunk = self._fetch(path, b, e, tensor=tensor).data
                if self.cache is not None:
                    self.cache.put(key, chunk)
            buf[lo:hi] = chunk

    def read(self, path: RemotePath, begin: int, end: int, tensor: str | None = None, *,
             data: bool = True) -> bytes:
        out = bytearray(end - begin)
        self.pread(path, memoryview(out), begin, tensor, data=data)
        return bytes(out)

    # -- network --------------------------------------------------------------------------------
    def identity(self, path: RemotePath) -> str:
        """What ranges of ``path`` are cached under (`open_shard` sets it)."""
        with self._lock:
            return self._ident[path.url]

    def fetch(self, path: RemotePath, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of ``path`` from the network (not the range cache): for
        downloads, which keep their own files."""
        return self._fetch(path, begin, end, tensor=None).data

    def _fetch(self, path: RemotePath, begin: int | None, end: int | None, *,
               cap: int | None = None, tensor: str | None) -> Reply:
        if self.offline:
            raise RemoteReadError("not in the Hugging Face cache or the range cache, and "
                                  "HF_HUB_OFFLINE=1 allows no download", path=path,
                                  tensor=tensor)
        name = self._name(path)
        what = "the file" if begin is None else f"bytes [{begin}, {end})"
        reply = self._retrying(lambda: self.transport.get(name, begin, end, cap), path, tensor,
                               what)
        self._count_fetched(len(reply.data))
        with self._lock:
            seen = self._version.get(path.url)
        if seen is not None and begin is not None and (
                reply.total != seen[0] or (seen[1] and reply.validator and reply.validator
                                           != seen[1])):
            raise RemoteReadError(f"the file changed on the server while it was being read (size "
                                  f"{seen[0]}, {seen[1]} at open; now {reply.total}, "
                                  f"{reply.validator}): open the checkpoint again", path=path,
                                  tensor=tensor)
        return reply

    def _retrying(self, fn: Callable[[], Any], path, tensor: str | None, what: str):
        """``fn()`` retried on `Transient` errors per the policy; any failure becomes a
        RemoteReadError naming the file and the tensor."""
        r = self.retry
        start = time.monotonic()
        for attempt in range(1, r.attempts + 1):
            with self._lock:
                self.stats.requests += 1
                self.stats.retries += attempt > 1
            try:
                return fn()
            except Transient as e:
                wait = min(r.max_wait_s, r.first_wait_s * 2 ** (attempt - 1))
                if e.retry_after is not None:
                    wait = min(r.max_wait_s, max(wait, e.retry_after))
                left = r.deadline_s - (time.monotonic() - start)
                if attempt == r.attempts or wait > left:
                    raise RemoteReadError(f"reading {what} failed after {attempt} attempt(s) "
                                          f"in {time.monotonic() - start:.1f} s: {e}",
                                          path=path, tensor=tensor) from e
                time.sleep(wait)
            except FetchError as e:
                raise RemoteReadError(f"reading {what} failed: {e}", path=path,
                                      tensor=tensor) from e
        raise AssertionError("unreachable")

    def _count_fetched(self, n: int) -> None:
        with self._lock:
            self.stats.fetched += n
            bar = self._progress()
        if bar is not None:
            bar.update(n)

    def _count_cached(self, n: int) -> None:
        with self._lock:
            self.stats.cached += n
            self.stats.cache_hits += 1

    def _progress(self):
        """The bytes-fetched bar, made on the first fetch (the caller holds the lock)."""
        if self._bar is None and self.options.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=f"fetch {self.source.label()}", unit="B", unit_scale=True,
                             unit_divisor=1024, leave=False)
        return self._bar

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        self.transport.close()

    def __repr__(self) -> str:
        return f"RemoteFolder({self.root.url!r})"
