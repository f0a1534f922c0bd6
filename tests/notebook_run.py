"""Executing a notebook headless in a test: papermill with limits on every wait.

papermill waits for a kernel's reply with no limit by default, so a kernel that stops answering
holds its pytest worker until pytest-timeout ends the worker (15 minutes, the test then reported
as a crashed worker). Here each cell has CELL_S and the kernel's start START_S: a kernel that
stops answering fails its test with nbclient's CellTimeoutError naming the cell and its source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# below the suite's 900 s per test (pyproject), above the slowest cell of a loaded CI machine
# (notebook 02's launch cell waits for its training job: about 2 minutes there)
CELL_S = 600
START_S = 120


def run_notebook(notebook: str | Path, out: str | Path, **kwargs: Any):
    import papermill

    kwargs.setdefault("execution_timeout", CELL_S)
    kwargs.setdefault("start_timeout", START_S)
    kwargs.setdefault("kernel_name", "python3")
    return papermill.execute_notebook(str(notebook), str(out), **kwargs)
