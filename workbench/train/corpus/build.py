"""Rebuild the shipped training corpus from a CPython 3.11 standard library (run by hand, once).

    python -m workbench.train.corpus.build /path/to/lib/python3.11

The corpus is every top-level ``*.py`` module of the standard library except the
machine-generated ``_sysconfigdata*`` files, concatenated in sorted name order, each file preceded
by a one-line header ``# <<< {name} >>>\\n``. It is stored xz-compressed next to this file
(``cpython311_stdlib.txt.xz``) with ``manifest.json`` (per file: name, byte offset, length,
sha256, split) and the PSF licence (``LICENSE-PSF.txt``). Every 10th file in sorted order is
validation, the rest training, so the split is by file and never leaks text across it.
"""

from __future__ import annotations

import hashlib
import lzma
import shutil
import sys
from pathlib import Path

from workbench._io import atomic_write_bytes, atomic_write_json

HERE = Path(__file__).resolve().parent
CORPUS_FILE = "cpython311_stdlib.txt.xz"
MANIFEST_FILE = "manifest.json"
LICENSE_FILE = "LICENSE-PSF.txt"
VAL_EVERY = 10


def build(stdlib: Path, out: Path = HERE) -> dict:
    names = sorted(p.name for p in stdlib.glob("*.py") if not p.name.startswith("_sysconfigdata"))
    if not names:
        raise FileNotFoundError(f"no *.py modules under {stdlib}")
    blob = bytearray()
    files = []
    for i, name in enumerate(names):
        text = (stdlib / name).read_bytes()
        blob += f"# <<< {name} >>>\n".encode()
        files.append({"name": name, "offset": len(blob), "length": len(text),
                      "sha256": hashlib.sha256(text).hexdigest(),
                      "split": "val" if i % VAL_EVERY == 0 else "train"})
        blob += text
    manifest = {
        "source": f"CPython {sys.version.split()[0]} standard library, top-level *.py modules "
                  f"(except _sysconfigdata*), from {stdlib}",
        "license": "PSF-2.0 (see LICENSE-PSF.txt)",
        "tokenizer": "bytes (vocab 256)",
        "val_rule": f"file index % {VAL_EVERY} == 0 in sorted order",
        "total_bytes": len(blob),
        "sha256": hashlib.sha256(bytes(blob)).hexdigest(),
        "files": files,
    }
    atomic_write_bytes(out / CORPUS_FILE, lzma.compress(bytes(blob), preset=9 | lzma.PRESET_EXTREME))
    atomic_write_json(out / MANIFEST_FILE, manifest)
    shutil.copyfile(stdlib / "LICENSE.txt", out / LICENSE_FILE)
    return manifest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    m = build(Path(sys.argv[1]))
    print(f"{len(m['files'])} files, {m['total_bytes']} bytes, sha256 {m['sha256']}")
