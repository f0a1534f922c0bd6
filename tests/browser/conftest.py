"""Browser tests: where they may skip, where their screenshots go.

They skip only where Chromium cannot be installed (not root, or not Debian): `.ci/test.sh`
installs Debian's `chromium` when it runs as root, so on a CI box of this kind a missing browser
is a failure, not a skip.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from browser_lab import CHROMIUM

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "notebooks" / "screenshots"


def _installable() -> bool:
    return os.geteuid() == 0 and Path("/etc/debian_version").exists()


@pytest.fixture
def browser_ready():
    pytest.importorskip("playwright", reason="needs playwright: pip install 'workbench[dev]'")
    if not CHROMIUM.exists():
        msg = (f"{CHROMIUM} is missing; install it with `apt-get install -y chromium` "
               "(.ci/test.sh does this when it runs as root on Debian)")
        if _installable():
            pytest.fail(msg)
        pytest.skip(msg + "; cannot install it here (needs root on Debian)")


@pytest.fixture
def artifacts(request) -> Path:
    """Per-test folder kept after the run (screenshots, the server log): CI uploads
    ``runs/test-artifacts``; BROWSER_ARTIFACTS moves it."""
    base = Path(os.environ.get("BROWSER_ARTIFACTS", ROOT / "runs" / "test-artifacts" / "browser"))
    d = base / re.sub(r"[^\w.-]+", "_", request.node.name)
    if d.exists():
        shutil.rmtree(d)  # no stale failure.png from an earlier run
    d.mkdir(parents=True)
    return d


@pytest.fixture
def screenshot_dirs(artifacts) -> list[Path]:
    """Where screenshots go once a test has passed: its artifacts folder (ignored by git), and
    also WORKBENCH_SCREENSHOTS_DIR when set. A test run never touches the tracked
    ``notebooks/screenshots`` by itself; `make screenshots` refreshes the README's pictures by
    setting WORKBENCH_SCREENSHOTS_DIR to that folder."""
    dirs = [artifacts]
    extra = os.environ.get("WORKBENCH_SCREENSHOTS_DIR")
    if extra:
        dirs.append(Path(extra).resolve())
    return dirs
