"""Suite-wide rules: GPU and Transformer Engine tests skip, with the reason, where they cannot
run; a hung test is named, with its stacks, while the run goes on."""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import pytest

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
# Nothing in the suite may need the network (CI machines have none, and a resolver that drops
# packets turns a hub lookup into a long stall, not an error): the Hugging Face libraries answer
# from local files or fail at once. Set here, before any test imports them; subprocesses and
# Slurm jobs inherit it.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's interpreter. @triton.jit reads this variable
# when a kernel module is imported, so it must be set before any test imports workbench.kernels
# (under xdist any test module may be first), hence here and not in tests/kernels/conftest.py.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _inductor_cpp_blocked() -> str | None:
    """Why torch.compile's C++ backend cannot build here, if it cannot: Inductor (torch 2.13)
    passes torch's include and library folders to g++ unquoted, so a torch installed under a path
    with whitespace (a clone in "/tmp/with space/") fails to link every compiled kernel. The
    workbench then takes its reference path (logged); the tests that are about the compiled path
    itself cannot run."""
    import torch

    folder = os.path.dirname(torch.__file__)
    if any(c.isspace() for c in folder):
        return (f"torch is installed under a path with whitespace ({folder!r}); Inductor's "
                "C++ build line does not quote it (torch 2.13), so nothing compiles")
    return None


def pytest_collection_modifyitems(config, items):
    blocked = _inductor_cpp_blocked()
    has_cuda = _cuda()
    # TE needs CUDA libraries at import; probing the spec does not import it.
    has_te = has_cuda and importlib.util.find_spec("transformer_engine") is not None
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))
        if item.get_closest_marker("inductor_cpp") and blocked:
            item.add_marker(pytest.mark.skip(reason=blocked))
        if item.get_closest_marker("te") and not has_te:
            item.add_marker(pytest.mark.skip(reason="needs transformer-engine with CUDA"))


# -- A hung or overlong test is named while it happens --------------------------------------------
# pytest-timeout ends a hung test's worker with os._exit: under xdist its stack dump is lost and the
# test's name appears only in the final summary, which a run killed at CI's limit never prints.
# So each worker has faulthandler write its stacks to a file shortly before the limit, and the
# controller prints that file the moment the worker is reported crashed. A suite-wide limit
# (WORKBENCH_SUITE_LIMIT_S, set by .ci/test.sh; SIGTERM does the same) names the tests still
# running and ends the run with pytest's summary instead of being killed without one.
_RUNNING: dict[str, float] = {}  # the controller's view: test id -> when it started


def _test_limit(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:
        return 0.0


def _say(config, text: str) -> None:
    """A line in pytest's own output, in order with its progress (stderr when it has none)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print(text, file=sys.stderr, flush=True)
    else:
        reporter.write_line(text)
        reporter.flush()


def _time_is_up(config, signum: int):
    now = time.monotonic()
    running = ", ".join(f"{n} ({now - t:.0f} s)" for n, t in sorted(_RUNNING.items())) or "none"
    name = signal.Signals(signum).name
    _say(config, f"\nsuite stopped by {name}; tests still running: {running}")
    raise KeyboardInterrupt(f"suite stopped by {name}")


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return
    if "WORKBENCH_TEST_STACKS" not in os.environ:
        config._workbench_stacks = os.environ["WORKBENCH_TEST_STACKS"] = tempfile.mkdtemp(
            prefix="pytest-stacks-")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: _time_is_up(config, signum))
        limit = float(os.environ.get("WORKBENCH_SUITE_LIMIT_S") or 0)
        if limit > 0:
            timer = threading.Timer(limit, os.kill, (os.getpid(), signal.SIGTERM))
            timer.daemon = True
            timer.start()


def pytest_unconfigure(config):
    folder = getattr(config, "_workbench_stacks", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("WORKBENCH_TEST_STACKS", None)


def pytest_runtest_logstart(nodeid, location):
    _RUNNING[nodeid] = time.monotonic()


def pytest_runtest_logfinish(nodeid, location):
    _RUNNING.pop(nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder, worker = os.environ.get("WORKBENCH_TEST_STACKS"), os.environ.get("PYTEST_XDIST_WORKER")
    limit = _test_limit(item)
    if not (folder and worker and limit > 0 and os.path.isdir(folder)):
        yield
        return
    with open(os.path.join(folder, f"{worker}.txt"), "w") as f:
        f.write(f"{item.nodeid}\n")
        f.flush()
        # shortly before the limit: 5% of it, at least a second (a loaded machine's jitter)
        faulthandler.dump_traceback_later(max(0.5 * limit, limit - max(1.0, 0.05 * limit)),
                                          file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist's controller, when a worker died running `crashitem`: say so now, with its stacks."""
    _RUNNING.pop(crashitem, None)
    stacks = ""
    folder, worker = os.environ.get("WORKBENCH_TEST_STACKS"), getattr(
        getattr(report.node, "gateway", None), "id", None)
    if folder and worker:
        try:
            with open(os.path.join(folder, f"{worker}.txt")) as f:
                stacks = f.read(20000)
        except OSError:
            pass
    _say(sched.config, f"\nworker {worker} died running {crashitem}\n{stacks}")
