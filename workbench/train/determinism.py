"""Deterministic mode (`TrainConfig.deterministic`, `--deterministic`): bitwise-reproducible runs
on a GPU. What was nondeterministic and what fixed each source: docs/determinism.md.

`CUBLAS_WORKSPACE_CONFIG` is read when the first cuBLAS handle is created, so `enable` must run
before the first CUDA matmul (the trainer CLI calls it before the process group and the model
exist); launchers also put `LAUNCH_ENV` in every rank's environment.
"""

from __future__ import annotations

import os

# torch is imported inside the functions: the launch layer reads LAUNCH_ENV from here, and
# `import workbench.launch` stays free of torch (tests/launch/test_launch_spec.py).

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
# cuBLAS's documented deterministic settings are ":4096:8" and ":16:8" (one fixed workspace per
# stream, so split-K reductions keep their order); the larger one keeps the faster kernels.
CUBLAS_VALUE = ":4096:8"
LAUNCH_ENV = {CUBLAS_ENV: CUBLAS_VALUE}
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def enable(deterministic: bool) -> None:
    """Switch this process's PyTorch into deterministic mode (or leave it as it is).

    Raises when the cuBLAS workspace is set to a value that is not deterministic: a run that asks
    for bit-reproducibility must not quietly get less."""
    if not deterministic:
        return
    import torch

    current = os.environ.get(CUBLAS_ENV)
    if current is None:
        os.environ[CUBLAS_ENV] = CUBLAS_VALUE
    elif current not in _DETERMINISTIC_CUBLAS:
        raise ValueError(f"--deterministic needs {CUBLAS_ENV} unset or one of "
                         f"{_DETERMINISTIC_CUBLAS}, the environment has {current!r}")
    # Every op with a deterministic variant uses it (SDPA's flash / efficient backward, CUDA
    # index_put accumulate, ...), and an op without one raises instead of running.
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also fills every fresh allocation with NaN, so a read of uninitialised
    # memory is reproducible. It costs a tenth of a GPU step (docs/determinism.md) and changes
    # nothing: runs without it give the same losses bit for bit, since the workbench reads no
    # uninitialised memory.
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def is_enabled() -> bool:
    import torch

    return torch.are_deterministic_algorithms_enabled()
