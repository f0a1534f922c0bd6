"""A test run leaves the clone unmodified: screenshots go to ignored folders unless asked for."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import ROOT, SCREENSHOTS


def _tracked_or_unignored(path) -> bool:
    """True if git would see files written into `path` (inside the clone, not ignored)."""
    try:
        rel = path.resolve().relative_to(ROOT)
    except ValueError:
        return False  # outside the clone
    probe = rel / "probe.png"
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(probe)],
                             check=False).returncode == 0
    return not ignored


def test_screenshots_go_only_where_asked(screenshot_dirs):
    """Only an explicit WORKBENCH_SCREENSHOTS_DIR (what `make screenshots` sets) may name a
    tracked folder; everything else a test writes screenshots into is ignored by git."""
    asked = os.environ.get("WORKBENCH_SCREENSHOTS_DIR")
    asked_dir = Path(asked).resolve() if asked else None
    if asked_dir != SCREENSHOTS.resolve():
        assert SCREENSHOTS.resolve() not in [d.resolve() for d in screenshot_dirs]
    for d in screenshot_dirs:
        if d.resolve() != asked_dir:
            assert not _tracked_or_unignored(d), f"a test run would write into the clone: {d}"
