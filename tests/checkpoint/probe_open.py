"""Open checkpoint folders in a child process and print one JSON line per folder.

Used for hostile inputs whose failure mode would be a hang (a FIFO) or exhausting memory
(`/dev/zero`, 10^7 empty experts): the parent runs this with a timeout, and the address space
is capped here, so a regression fails as MemoryError or a timeout instead of taking the
machine. `python probe_open.py DIR [DIR ...]`; with `--records` also builds expert records.
"""

from __future__ import annotations

import json
import resource
import sys

# 8 GiB of address space: torch's import needs ~2; reading /dev/zero would need all of it
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

from workbench.checkpoint import CheckpointError, open_checkpoint


def main(argv: list[str]) -> None:
    records = "--records" in argv
    for d in (a for a in argv if a != "--records"):
        try:
            ck = open_checkpoint(d)
            out = {"dir": d, "ok": ck.layout, "records": len(ck.experts()) if records else None}
        except CheckpointError as e:
            out = {"dir": d, "error": type(e).__name__, "path": e.path, "message": str(e)}
        except BaseException as e:  # noqa: BLE001 - the parent reports what leaked
            out = {"dir": d, "error": "UNEXPECTED " + type(e).__name__, "message": repr(e)[:500]}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
