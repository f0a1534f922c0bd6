"""Executing a notebook headless in a test: papermill with limits on every wait.

papermill waits for a kernel's reply with no limit by default, so a kernel that stops answering
holds its pytest worker until pytest-timeout ends the worker (15 minutes, the test then reported
as a crashed worker). Here each cell has CELL_S and the kernel's start START_S: a kernel that
stops answering fails its test with nbclient's CellTimeoutError naming the cell and its source,
followed by the kernel's own thread stacks (the kernel dumps them to a file every CELL_S - 20
seconds through faulthandler, set up by an IPython startup file in a private IPYTHONDIR).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

# below the suite's 900 s per test (pyproject), above the slowest cell of a loaded CI machine
# (notebook 02's launch cell waits for its training job: about 2 minutes there)
CELL_S = 600
START_S = 120

_STARTUP = """\
import faulthandler
_wb_stacks = open({path!r}, "w")
faulthandler.dump_traceback_later({period}, repeat=True, file=_wb_stacks)
"""


def run_notebook(notebook: str | Path, out: str | Path, **kwargs: Any):
    import papermill
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    kwargs.setdefault("execution_timeout", CELL_S)
    kwargs.setdefault("start_timeout", START_S)
    kwargs.setdefault("kernel_name", "python3")
    period = max(1, CELL_S - 20)
    with tempfile.TemporaryDirectory(prefix="nb-kernel-") as home:
        stacks = Path(home) / "kernel-stacks.txt"
        startup = Path(home) / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-stacks.py").write_text(_STARTUP.format(path=str(stacks), period=period))
        before = os.environ.get("IPYTHONDIR")
        os.environ["IPYTHONDIR"] = home  # the kernel papermill starts inherits it
        try:
            return papermill.execute_notebook(str(notebook), str(out), **kwargs)
        except (CellTimeoutError, DeadKernelError) as e:
            dumped = stacks.read_text() if stacks.exists() else ""
            raise type(e)(f"{e}\n--- the kernel's threads (faulthandler, every {period} s):\n"
                          f"{dumped[-20000:] or '(none dumped)'}") from e
        finally:
            if before is None:
                os.environ.pop("IPYTHONDIR", None)
            else:
                os.environ["IPYTHONDIR"] = before
