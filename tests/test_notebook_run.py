"""tests/notebook_run.py, the way every notebook test executes its notebook."""

from __future__ import annotations

import re
import time

import pytest


def test_a_notebook_cell_that_stops_answering_fails_its_test(tmp_path, monkeypatch):
    """tests/notebook_run.py: papermill's wait for a cell has a limit (CELL_S), so a kernel that
    stops answering fails the test naming the cell and showing where the kernel waited, instead
    of holding its worker until pytest-timeout ends it."""
    pytest.importorskip("papermill", reason="needs the notebooks extra")
    import nbformat
    import notebook_run
    from nbclient.exceptions import CellTimeoutError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time\ntime.sleep(120)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    src = tmp_path / "sleeps.ipynb"
    nbformat.write(nb, src)
    monkeypatch.setattr(notebook_run, "CELL_S", 3)
    t0 = time.monotonic()
    with pytest.raises(CellTimeoutError, match="time.sleep") as caught:
        notebook_run.run_notebook(src, tmp_path / "out.ipynb", progress_bar=False)
    assert time.monotonic() - t0 < 100
    # the kernel's own stack, where it waited: the cell's second line, in the kernel's main thread
    said = str(caught.value)
    assert "the kernel's threads" in said
    assert re.search(r"line 2 in <module>", said.split("the kernel's threads")[1]), said[-3000:]
