"""Suite-wide rules: GPU and Transformer Engine tests skip, with the reason, where they cannot run."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's interpreter. @triton.jit reads this variable
# when a kernel module is imported, so it must be set before any test imports workbench.kernels
# (under xdist any test module may be first), hence here and not in tests/kernels/conftest.py.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda()
    # TE needs CUDA libraries at import; probing the spec does not import it.
    has_te = has_cuda and importlib.util.find_spec("transformer_engine") is not None
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))
        if item.get_closest_marker("te") and not has_te:
            item.add_marker(pytest.mark.skip(reason="needs transformer-engine with CUDA"))
