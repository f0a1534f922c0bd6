"""Kernel tests run the Triton kernels on a GPU when one is visible, else under the Triton
interpreter on CPU (TRITON_INTERPRET must be set before the kernels are first compiled)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
