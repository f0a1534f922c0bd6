"""The folder an export is written into, and its swap into place.

An export is written into `.tmp-NAME` beside its destination `NAME`, and only when every file is
written (shards, tokenizer, index, config.json) does it replace `NAME`: `NAME` -> `.old-NAME`,
`.tmp-NAME` -> `NAME`, `.old-NAME` removed. A crash at any point leaves either the previous
complete export or the new one under `NAME` (`recover_swap` puts things right), never a folder
that looks finished and is not.

Ownership: the first file written into `.tmp-NAME` is the marker `MARKER`; it travels with the
folder through both renames. Only a folder that carries it (or an empty one) is ever replaced or
removed here: a destination the user filled by hand, a model folder given by mistake, a stray
`.tmp-NAME` of someone else's is refused with ExportError naming it and left as it is. When an
export is removed, the marker goes last, so a removal cut short still carries it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from workbench._io import atomic_write_json, fsync_path

MARKER = ".workbench-export"
_MARK = {"format": "workbench.export/1"}  # no time or host: two exports of one model are equal


class ExportFolderError(ValueError):
    """A folder in the export's way is not an export the workbench wrote."""


def tmp_of(out_dir: Path) -> Path:
    return out_dir.parent / f".tmp-{out_dir.name}"


def old_of(out_dir: Path) -> Path:
    return out_dir.parent / f".old-{out_dir.name}"


def is_ours(path: Path) -> bool:
    """Whether `path` may be replaced or removed: absent, an empty folder, or a folder that
    carries the marker (not a symlink: its target is not ours to judge)."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_symlink() or not path.is_dir():
        return False
    return (path / MARKER).is_file() or not any(path.iterdir())


def check_replaceable(out_dir: str | Path) -> None:
    """ExportFolderError unless the destination and the swap's two side folders are absent or
    exports of ours: checked before the export starts (the trainer checks before step 1)."""
    out_dir = Path(out_dir)
    for p in (out_dir, tmp_of(out_dir), old_of(out_dir)):
        if not is_ours(p):
            raise ExportFolderError(
                f"{p} exists and is not an export the workbench wrote (no {MARKER} in it); "
                "move it away or export elsewhere")


def remove(path: Path) -> None:
    """Remove an export folder of ours, its marker last (a removal cut short stays ours)."""
    if not path.exists():
        return
    for p in path.iterdir():
        if p.name == MARKER:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    (path / MARKER).unlink(missing_ok=True)
    path.rmdir()


def begin(out_dir: str | Path) -> Path:
    """A fresh, marked `.tmp-NAME` for the export of `out_dir` (the leftover of a crashed
    export removed); ExportFolderError when something in the way is not ours."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    tmp = tmp_of(out_dir)
    remove(tmp)
    tmp.mkdir(parents=True)
    atomic_write_json(tmp / MARKER, _MARK)
    return tmp


def recover_swap(out_dir: str | Path) -> None:
    """Undo what a crash left of an earlier export's swap (`out_dir` -> `.old-*`, `.tmp-*` ->
    `out_dir`, remove `.old-*`), so the next swap cannot fail on a leftover `.old-*`:
    - `.old-*` and `out_dir` both present (killed after the second rename, or while `.old-*`
      was being removed): `out_dir` is the newer complete export; `.old-*` goes;
    - only `.old-*` (killed between the renames): it is the last complete export; it goes back
      to `out_dir`, so readers find an export even if this one is killed too.
    A `.tmp-*` folder is never complete until renamed; the export removes and rewrites it.
    Only marked folders are touched (ExportFolderError otherwise)."""
    out_dir = Path(out_dir)
    old = old_of(out_dir)
    if not old.exists():
        return
    check_replaceable(out_dir)
    if out_dir.exists():
        remove(old)
    else:
        os.rename(old, out_dir)
    fsync_path(out_dir.parent)


def swap_into_place(tmp: Path, out_dir: Path) -> None:
    """The commit: the finished `.tmp-NAME` becomes `NAME`, the previous export goes."""
    old = old_of(out_dir)
    recover_swap(out_dir)
    check_replaceable(out_dir)
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_path(out_dir.parent)
    remove(old)
