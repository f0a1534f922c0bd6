"""torchrun worker for test_exit.py: runs the trainer's CLI, reports the gloo threads still alive
after it, and ends through exit_process. A module global's __del__ marks whether the interpreter's
finalisation ran (it frees module globals; os._exit skips it)."""

import json
import os
import sys
from pathlib import Path

REPORT = Path(sys.argv[1])
RANK = os.environ.get("RANK", "0")


class _Finalised:
    # Everything __del__ needs is bound now: finalisation may already have cleared the module's
    # other globals when it frees this one.
    def __del__(self, _open=open, _path=f"{REPORT}.{RANK}.finalised"):
        with _open(_path, "w") as f:
            f.write("1")


SENTINEL = _Finalised()

from workbench.train.cli import cli
from workbench.train.distributed import exit_process, live_backend_threads

cli(sys.argv[2:])
Path(f"{REPORT}.{RANK}.json").write_text(json.dumps({"threads": live_backend_threads()}))
exit_process(0)
