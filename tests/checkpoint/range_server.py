"""A loopback HTTP server for the remote-read tests: serves a folder with Range support,
counts every byte of file content it sends, and injects faults on request.

It is written from RFC 9110's rules (206 + Content-Range for a satisfiable range, 416 for one
past the end, 200 for a request without Range), not from the client under test. Faults
(`Fault`) match a file and a request number and replace the normal answer: ``"500"`` (an
error status), ``"truncate"`` (the right headers, half the body, then the connection closed),
``"short206"`` (a 206 announcing and sending fewer bytes than asked), ``"ignore_range"`` (200
with the whole file), ``"wrong_range"`` (206 for another range). ``hub_repo`` additionally
answers the few Hugging Face Hub routes the hub client uses, for one repository at one commit.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Fault:
    file: str  # the served file's name, relative to the folder
    kind: str  # 500 | truncate | short206 | ignore_range | wrong_range | 503
    times: int = 1  # answer this many matching requests with the fault, then serve normally
    after: int = 0  # skip this many matching requests first
    min_begin: int = 0  # only ranges that begin at or after this byte


@dataclass
class Log:
    served: int = 0  # bytes of file content sent (bodies of 200 and 206 replies)
    per_file: dict = field(default_factory=dict)
    requests: list = field(default_factory=list)  # (method, file, range header, status)


class RangeServer:
    def __init__(self, folder: Path, *, hub_repo: str | None = None, commit: str = "0" * 40):
        self.folder = Path(folder)
        self.faults: list[Fault] = []
        self.log = Log()
        self.hub_repo, self.commit = hub_repo, commit
        self._lock = threading.Lock()
        self._tls = threading.local()  # per request: the hub headers of the file asked for
        self._seen: dict[int, int] = {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                server._handle(self)

            def do_HEAD(self):
                server._handle(self, head=True)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def reset(self) -> None:
        with self._lock:
            self.log = Log()

    # -- answers --------------------------------------------------------------------------------
    def _fault(self, name: str, begin: int) -> str | None:
        with self._lock:
            for i, f in enumerate(self.faults):
                if f.file != name or begin < f.min_begin:
                    continue
                n = self._seen.get(i, 0)
                self._seen[i] = n + 1
                if f.after <= n < f.after + f.times:
                    return f.kind
        return None

    def _send(self, h, status: int, body: bytes, headers: dict, name: str | None,
              count: bool = True, cut: int | None = None, head: bool = False) -> None:
        sent = b"" if head else body if cut is None else body[:cut]
        # logged before any byte goes out: a client that has its reply (for an empty body, the
        # headers are all of it) finds it in the log, never after a reset that followed it
        with self._lock:
            self.log.requests.append(("HEAD" if head else "GET", name, h.headers.get("Range"),
                                      status))
            if count and 200 <= status < 300 and name is not None:
                self.log.served += len(sent)
                self.log.per_file[name] = self.log.per_file.get(name, 0) + len(sent)
        h.send_response(status)
        for k, v in {**getattr(self._tls, 'extra', {}), **headers}.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        if cut is not None:
            h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(sent)
        if cut is not None:
            h.wfile.flush()
            h.close_connection = True

    def _handle(self, h, head: bool = False) -> None:
        self._tls.extra = {}
        path = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path)
        if self.hub_repo is not None:
            api = f"/api/models/{self.hub_repo}"
            if path == api or path.startswith(api + "/revision/"):
                doc = {"id": self.hub_repo, "sha": self.commit, "siblings": [
                    {"rfilename": n} for n in self._names()]}
                return self._send(h, 200, json.dumps(doc).encode(),
                                  {"Content-Type": "application/json"}, None, count=False)
            if path.startswith(api + "/tree/"):
                doc = [{"type": "file", "path": n, "size": (self.folder / n).stat().st_size,
                        "oid": "0" * 40} for n in self._names()]
                return self._send(h, 200, json.dumps(doc).encode(),
                                  {"Content-Type": "application/json"}, None, count=False)
            prefix = f"/{self.hub_repo}/resolve/"
            if not path.startswith(prefix):
                return self._send(h, 404, b"", {}, None)
            rev, _, rel = path[len(prefix):].partition("/")
            if rev not in (self.commit, "main"):
                return self._send(h, 404, b"", {}, None)
            path = "/" + rel
            f = self.folder / rel
            if f.is_file():  # what huggingface_hub's downloads read from a HEAD
                self._tls.extra = {"X-Repo-Commit": self.commit,
                               "ETag": '"' + hashlib.sha256(f.read_bytes()).hexdigest() + '"'}
        name = path.lstrip("/")
        f = (self.folder / name).resolve()
        if not f.is_relative_to(self.folder.resolve()) or not f.is_file():
            return self._send(h, 404, b"", {}, name)
        data = f.read_bytes()
        size = len(data)
        if head:
            return self._send(h, 200, data, {}, name, count=False, head=True)
        rng = h.headers.get("Range")
        m = _RANGE.match(rng.strip()) if rng is not None else None
        fault = self._fault(name, int(m.group(1)) if m else 0)
        if fault in ("500", "503"):
            return self._send(h, int(fault), b"", {}, name)
        rng = h.headers.get("Range")
        etag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'  # changes with the content
        if rng is None or fault == "ignore_range":
            return self._send(h, 200, data, {"ETag": etag}, name,
                              cut=size // 2 if fault == "truncate" else None)
        if not m:
            return self._send(h, 416, b"", {"Content-Range": f"bytes */{size}"}, name)
        b = int(m.group(1))
        e = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        if b >= size or e < b:
            return self._send(h, 416, b"", {"Content-Range": f"bytes */{size}"}, name)
        if fault == "wrong_range":
            b, e = max(0, b - 1), max(0, e - 1)
        body = data[b:e + 1]
        if fault == "short206":
            body = body[: max(0, len(body) // 2)]
            e = b + len(body) - 1
        return self._send(h, 206, body, {"Content-Range": f"bytes {b}-{e}/{size}",
                                         "ETag": etag, "Accept-Ranges": "bytes"}, name,
                          cut=len(body) // 2 if fault == "truncate" else None)

    def _names(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*")
                      if p.is_file())
