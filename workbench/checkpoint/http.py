"""Byte ranges over HTTP(S), on the standard library's ``http.client``.

One GET per range with ``Range: bytes=B-E`` and ``Accept-Encoding: identity``. A reply is used
only when it is exactly what was asked: ``206`` with ``Content-Range: bytes B-E/TOTAL`` naming
the same range, and a body of exactly ``E - B + 1`` bytes (or a ``200`` whose body is the whole
file when the whole file was asked). Anything else raises, and says whether trying again may help
(`Transient`: 408, 429, 5xx, a reset or timed-out connection, a body cut short) or not
(`Permanent`: 401/403, 416, a server ignoring ranges, a reply for another range; `NotFound`: 404
and 410). Redirects are followed (the Hub's ``/resolve/`` URLs redirect to a CDN), at most
``MAX_REDIRECTS``, and the ``Authorization`` header is dropped when one leaves the host it was
meant for. Connections are kept alive per thread and host; proxies come from the usual
``https_proxy`` / ``no_proxy`` environment; certificates from the system store or
``SSL_CERT_FILE`` / ``REQUESTS_CA_BUNDLE``.
"""

from __future__ import annotations

import http.client
import os
import re
import ssl
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass

MAX_REDIRECTS = 10
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class FetchError(Exception):
    """A request failed; ``retry_after`` is the server's hint in seconds, if it gave one."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class Transient(FetchError):
    """Trying again may succeed."""


class Permanent(FetchError):
    """Trying again will not help."""


class NotFound(Permanent):
    """The server has no such file."""


@dataclass(frozen=True)
class Reply:
    data: bytes
    total: int | None  # the file's size, when the server said
    validator: str | None  # ETag or Last-Modified: changes when the file does


def _ssl_context() -> ssl.SSLContext:
    cafile = os.environ.get("SSL_CERT_FILE") or os.environ.get("REQUESTS_CA_BUNDLE") or None
    return ssl.create_default_context(cafile=cafile)


class HttpClient:
    """Range GETs against one or more hosts; safe to share between threads (each thread keeps
    its own connections)."""

    def __init__(self, headers: dict[str, str] | None = None, *, timeout_s: float = 60.0):
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._ssl: ssl.SSLContext | None = None
        self._every: list = []  # every thread's connections, so close() reaches them all
        self._every_lock = threading.Lock()

    # -- connections ----------------------------------------------------------------------------
    def _conns(self) -> dict:
        c = getattr(self._local, "conns", None)
        if c is None:
            c = self._local.conns = {}
        return c

    def _connect(self, scheme: str, host: str, port: int) -> tuple[http.client.HTTPConnection,
                                                                   bool]:
        """(connection, whether requests go to a proxy in absolute form)."""
        key = (scheme, host, port)
        conns = self._conns()
        if key in conns:
            return conns[key]
        proxy = None
        if host not in _LOOPBACK and not urllib.request.proxy_bypass(host):
            proxy = urllib.request.getproxies().get(scheme)
        absolute = False
        if scheme == "https":
            if self._ssl is None:
                self._ssl = _ssl_context()
            if proxy:
                p = urllib.parse.urlsplit(proxy)
                conn = http.client.HTTPSConnection(p.hostname, p.port or 443 if p.scheme ==
                                                   "https" else p.port or 80,
                                                   timeout=self.timeout_s, context=self._ssl)
                conn.set_tunnel(host, port)
            else:
                conn = http.client.HTTPSConnection(host, port, timeout=self.timeout_s,
                                                   context=self._ssl)
        elif scheme == "http":
            if proxy:
                p = urllib.parse.urlsplit(proxy)
                conn = http.client.HTTPConnection(p.hostname, p.port or 80,
                                                  timeout=self.timeout_s)
                absolute = True
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        else:
            raise Permanent(f"unsupported URL scheme {scheme!r}")
        conns[key] = (conn, absolute)
        with self._every_lock:
            self._every.append(conn)
        return conns[key]

    def _drop(self, scheme: str, host: str, port: int) -> None:
        got = self._conns().pop((scheme, host, port), None)
        if got is not None:
            got[0].close()
            with self._every_lock:
                if got[0] in self._every:
                    self._every.remove(got[0])

    def close(self) -> None:
        """Close every thread's connections (a later request opens new ones)."""
        with self._every_lock:
            every, self._every = self._every, []
        for conn in every:
            conn.close()
        self._conns().clear()

    # -- requests -------------------------------------------------------------------------------
    def get(self, url: str, begin: int | None = None, end: int | None = None, *,
            cap: int | None = None) -> Reply:
        """Bytes ``[begin, end)`` of ``url``; with neither, the whole file (at most ``cap``
        bytes, else `Permanent`)."""
        ranged = begin is not None
        if ranged and (end is None or not 0 <= begin < end):
            raise ValueError(f"bad range [{begin}, {end})")
        headers = {**self.headers, "Accept-Encoding": "identity"}
        if ranged:
            headers["Range"] = f"bytes={begin}-{end - 1}"
        origin = urllib.parse.urlsplit(url).hostname
        for _ in range(MAX_REDIRECTS + 1):
            u = urllib.parse.urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise Permanent(f"cannot fetch {url!r}: not an http(s) URL")
            if u.hostname != origin:  # credentials stay with the host they were given for
                headers.pop("Authorization", None)
            port = u.port or (443 if u.scheme == "https" else 80)
            conn, absolute = self._connect(u.scheme, u.hostname, port)
            target = url if absolute else (u.path or "/") + (f"?{u.query}" if u.query else "")
            try:
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._drop(u.scheme, u.hostname, port)
                raise Transient(f"request failed: {type(e).__name__}: {e}") from e
            try:
                if resp.status in (301, 302, 303, 307, 308):
                    loc = resp.getheader("Location")
                    resp.read()
                    if not loc:
                        raise Permanent(f"HTTP {resp.status} without a Location header")
                    url = urllib.parse.urljoin(url, loc)
                    continue
                return self._reply(resp, begin, end, cap)
            except (OSError, http.client.HTTPException) as e:
                self._drop(u.scheme, u.hostname, port)
                raise Transient(f"reading the response failed: {type(e).__name__}: {e}") from e
            except FetchError:
                self._drop(u.scheme, u.hostname, port)
                raise
            finally:
                if resp.will_close:
                    self._drop(u.scheme, u.hostname, port)
        raise Permanent(f"more than {MAX_REDIRECTS} redirects")

    @staticmethod
    def _reply(resp: http.client.HTTPResponse, begin: int | None, end: int | None,
               cap: int | None) -> Reply:
        status = resp.status
        validator = resp.getheader("ETag") or resp.getheader("Last-Modified")
        if status in (404, 410):
            resp.read(1 << 16)
            raise NotFound(f"HTTP {status}: no such file")
        if status == 416:
            rng = resp.getheader("Content-Range") or ""
            raise Permanent(f"HTTP 416: range [{begin}, {end}) is not inside the file "
                            f"({rng.strip() or 'size not given'})")
        if status in (401, 403):
            raise Permanent(f"HTTP {status}: access denied (a gated or private repository "
                            "needs HF_TOKEN)")
        if status in TRANSIENT_STATUS:
            raise Transient(f"HTTP {status}", retry_after=_retry_after(resp))
        if status >= 500:
            raise Transient(f"HTTP {status}")
        if status == 206 and begin is not None:
            m = _CONTENT_RANGE.match(resp.getheader("Content-Range") or "")
            if not m or (int(m.group(1)), int(m.group(2))) != (begin, end - 1):
                raise Permanent(f"the server answered Content-Range "
                                f"{resp.getheader('Content-Range')!r} to a request for bytes "
                                f"{begin}-{end - 1}")
            total = None if m.group(3) == "*" else int(m.group(3))
            data = _read_exact(resp, end - begin)
            return Reply(data, total, validator)
        if status == 200:
            length = resp.getheader("Content-Length")
            total = int(length) if length and length.isdigit() else None
            if begin is not None:
                if begin == 0 and total == end:  # asked for the whole file: this is it
                    return Reply(_read_exact(resp, end), total, validator)
                raise Permanent("the server ignores Range requests (HTTP 200 with the whole "
                                "file): remote reads need a server that supports ranges")
            if cap is not None and total is not None and total > cap:
                raise Permanent(f"file is {total} bytes, over the {cap}-byte limit")
            limit = (cap if cap is not None else 1 << 40) + 1
            data = resp.read(limit) if total is None else _read_exact(resp, total)
            if cap is not None and len(data) > cap:
                raise Permanent(f"file is over the {cap}-byte limit")
            return Reply(data, total if total is not None else len(data), validator)
        raise Permanent(f"unexpected HTTP {status} {resp.reason}")


def _read_exact(resp: http.client.HTTPResponse, n: int) -> bytes:
    """Exactly ``n`` body bytes; a body that ends early is `Transient` (the connection was cut),
    a reply announcing another length `Permanent`."""
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) != n:
        raise Permanent(f"the server announced {int(length)} bytes for a {n}-byte request")
    try:
        data = resp.read(n)
    except http.client.IncompleteRead as e:
        raise Transient(f"short read: {len(e.partial)} of {n} bytes arrived") from None
    except (TimeoutError, OSError) as e:
        raise Transient(f"reading the body failed: {type(e).__name__}: {e}") from e
    if len(data) != n:
        raise Transient(f"short read: {len(data)} of {n} bytes arrived")
    return data


def _retry_after(resp: http.client.HTTPResponse) -> float | None:
    v = resp.getheader("Retry-After")
    try:
        resp.read(1 << 16)
    except (OSError, http.client.HTTPException):
        pass
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None
