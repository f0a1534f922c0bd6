"""A real JupyterLab on localhost, driven by headless Debian Chromium through Playwright.

The server runs from the project's venv (so the notebook kernel is the venv's Python), token-less
on a random free port, with its own settings/runtime/config folders so neither the user's Jupyter
set-up nor a news pop-up can change what the browser sees. Playwright only steers the system
Chromium: its own browser download is impossible here.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = Path(os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 1000}

# User-level JupyterLab settings: no network calls for news/updates, no toasts over the page.
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def jupyter_lab(root: Path, scratch: Path, *, timeout_s: float = 90):
    """Start ``jupyter lab`` serving ``root``; yields its base URL; stops it (whole group) after."""
    for sub in ("settings", "workspaces", "runtime", "config"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    for rel, value in _SETTINGS.items():
        p = scratch / "settings" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))
    venv_bin = Path(sys.executable).parent
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(scratch / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(scratch / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(scratch / "runtime"), JUPYTER_CONFIG_DIR=str(scratch / "config"),
               PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
               TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", PYTHONUNBUFFERED="1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (scratch / "jupyter.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--ServerApp.port_retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=None", "--expose-app-in-browser",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({proc.returncode}):\n{_tail(scratch / 'jupyter.log')}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"jupyter lab not up after {timeout_s}s:\n{_tail(scratch / 'jupyter.log')}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the kernels it started
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@contextmanager
def chromium(user_data_dir: Path):
    """A Playwright page in headless system Chromium with a fresh profile."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport=VIEWPORT, device_scale_factor=1)
        try:
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            yield page
        finally:
            ctx.close()


def copy_notebook(src: Path, dst: Path, parameters: dict) -> Path:
    """Copy a notebook, appending assignments of ``parameters`` to its ``parameters`` cell (what
    papermill does, so the browser opens the notebook as a user would after editing it); the
    notebook's own defaults stay for every parameter the test does not set."""
    nb = json.loads(src.read_text())
    cells = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"{src}: expected one cell tagged 'parameters', found {len(cells)}")
    own = cells[0]["source"]
    own = "".join(own) if isinstance(own, list) else own
    cells[0]["source"] = own.rstrip("\n") + "\n# set by the test\n" + "".join(
        f"{k} = {v!r}\n" for k, v in parameters.items())
    dst.write_text(json.dumps(nb, indent=1))
    return dst


# --- driving a notebook panel ---------------------------------------------------------------

# The notebook model as the browser holds it: one entry per cell with its outputs.
_CELLS_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  return nb.model.toJSON().cells.map(c => ({type: c.cell_type,
    source: Array.isArray(c.source) ? c.source.join('') : c.source,
    count: c.execution_count ?? null, outputs: (c.outputs || []).map(o => ({
      type: o.output_type, ename: o.ename || null, evalue: o.evalue || null,
      mimes: Object.keys(o.data || {})}))}));
}"""


def open_notebook(page, url: str, name: str, *, timeout_s: float = 60) -> None:
    """Open ``name`` in a fresh workspace (``?reset``: no tabs restored from an earlier visit)
    and wait until it is the current panel with an idle kernel."""
    page.goto(f"{url}/lab/tree/{name}?reset", wait_until="domcontentloaded")
    page.wait_for_function(
        """name => {
          const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
          const k = w && w.context && w.context.path === name && w.sessionContext.session
                    && w.sessionContext.session.kernel;
          return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
        }""", arg=name, timeout=timeout_s * 1000)
    # The kernel indicator in the notebook toolbar names the venv kernel once it is up.
    page.locator(".jp-NotebookPanel-toolbar").get_by_text("Python 3").first.wait_for(
        timeout=timeout_s * 1000)


def run_all_from_menu(page) -> None:
    """Run > Run All Cells, clicked the way a user does."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.get_by_role("menuitem", name="Run All Cells", exact=False).first.click()


def cells(page) -> list[dict]:
    return page.evaluate(_CELLS_JS)


def kernel_busy(page) -> bool:
    return page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext"
                         ".session.kernel.status !== 'idle'")


def wait_all_executed(page, *, timeout_s: float, poll=None) -> list[dict]:
    """Wait until every code cell has an execution count and the kernel is idle; an error output
    stops the wait at once. ``poll(page)`` is called while waiting (to watch live progress)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cs = cells(page)
        errors = [o for c in cs for o in c["outputs"] if o["type"] == "error"]
        if errors:
            raise AssertionError(f"a cell raised: {errors[0]['ename']}: {errors[0]['evalue']}")
        code = [c for c in cs if c["type"] == "code"]
        if code and all(c["count"] is not None for c in code) and not kernel_busy(page):
            return cs
        if time.monotonic() > deadline:
            raise TimeoutError(f"notebook not done after {timeout_s}s: execution counts "
                               f"{[c['count'] for c in code]}")
        if poll is not None:
            poll(page)
        page.wait_for_timeout(500)


def png_images(locator) -> list[bytes]:
    """The PNG bytes of every rendered ``img`` (data URL) under ``locator``, checking each really
    decoded in the browser (non-zero natural size)."""
    out = []
    for img in locator.locator("img").all():
        src = img.get_attribute("src") or ""
        if not src.startswith("data:image/png;base64,"):
            continue
        w = img.evaluate("e => e.complete ? e.naturalWidth : 0")
        if w <= 0:
            continue
        out.append(base64.b64decode(src.split(",", 1)[1]))
    return out
