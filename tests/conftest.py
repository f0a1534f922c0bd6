"""Suite-wide rules: GPU and Transformer Engine tests skip, with the reason, where they cannot run."""

from __future__ import annotations

import importlib.util
import os

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
