"""`make lab` (jobs/lab.sh): the URL it prints opens the inspection notebook in a browser, and
Ctrl-C / SIGTERM stops the server with it."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from browser_lab import chromium, free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _lines(proc) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def test_make_lab_prints_a_working_url(tmp_path, browser_ready, artifacts):
    port = free_port()
    env = dict(os.environ, LAB_NO_DEMO="1", LAB_PORT=str(port),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    # Opening a notebook makes Jupyter write a checkpoint next to it: keep that out of the repo.
    proc = subprocess.Popen(["bash", "jobs/lab.sh", "--no-browser", "--ServerApp.port_retries=0",
                             f"--FileCheckpoints.checkpoint_dir={tmp_path / 'checkpoints'}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    log: list[str] = []
    try:
        q, url, deadline = _lines(proc), None, time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            try:
                line = q.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            log.append(line)
            m = re.search(r"JupyterLab is running\. Open: (\S+)", line)
            url = m and m.group(1)
        assert url, "lab.sh printed no URL:\n" + "".join(log[-40:])
        # The link names this port and the notebook, and carries the server's token.
        nb = "/lab/tree/notebooks/01_inspect_checkpoint.ipynb?token="
        assert re.fullmatch(rf"http://(localhost|127\.0\.0\.1):{port}{re.escape(nb)}\w+", url), url
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
        with chromium(tmp_path / "profile") as page:
            # Through the printed link, token and all: the notebook opens with a running kernel.
            page.goto(url)
            tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tabLabel",
                               has_text="01_inspect_checkpoint.ipynb")
            tab.first.wait_for(timeout=60_000)
            page.locator("#jp-main-statusbar").get_by_text("Idle").first.wait_for(timeout=60_000)
            page.screenshot(path=str(artifacts / "make_lab.png"))
        proc.send_signal(signal.SIGTERM)  # what Ctrl-C's trap does: the server goes with it
        proc.wait(timeout=30)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        (artifacts / "lab.log").write_text("".join(log))
