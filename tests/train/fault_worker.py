"""The trainer's command line (`jobs/qat.py`'s entry point) with one fault injected, chosen by
environment variables; one process per rank (torchrun or RANK/WORLD_SIZE/MASTER_*).

    HANG_RANK=r HANG_STEP=n HANG_S=s   rank r sleeps s seconds before step n (a frozen rank)
    ENOSPC=metrics ENOSPC_STEP=n       rank 0's metrics line of step n meets a full disk
    ENOSPC=export ENOSPC_RANK=r        rank r's export shard meets a full disk
    ENOSPC=tokenizer                   copying the tokenizer into the export meets a full disk
    ENOSPC=token-cache                 writing the token cache meets a full disk
Each full disk is the OSError the kernel gives a write (errno ENOSPC, no file name), raised where
the bytes are written: what the trainer must turn into one line naming the device and the file.
"""

import errno
import os
import sys
import time

import safetensors.torch

from workbench import _io
from workbench.train import distributed, loop
from workbench.train.cli import console
from workbench.train.metrics import MetricsWriter

RANK = int(os.environ.get("RANK", "0"))


def _full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _hang(rank: int, at: int, seconds: float) -> None:
    real = loop.train_step

    def train_step(model, opt, sched, tokens, cfg, info, step, *a, **kw):
        if info.rank == rank and step == at:
            time.sleep(seconds)
        return real(model, opt, sched, tokens, cfg, info, step, *a, **kw)

    loop.train_step = train_step


def _metrics(at: int) -> None:
    real = MetricsWriter.write

    def write(self, record):
        if record.get("step") == at:
            raise _full()
        real(self, record)

    MetricsWriter.write = write


def _export_shard(rank: int) -> None:
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        if RANK == rank:
            with open(filename, "wb") as f:  # a part is written, then the disk is full
                f.write(b"\0" * 1024)
            raise _full()
        real(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = save_file


def _atomic_writes_to(name: str) -> None:
    """`_io.atomic_open`'s file object for a path ending in `name` fails its first write."""
    real = os.fdopen

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise _full()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def __getattr__(self, attr):
            return getattr(self._f, attr)

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return f
        return Full(f) if f".{name}." in os.path.basename(path) else f

    _io.os.fdopen = fdopen


def _token_cache() -> None:
    from workbench.train import datasets

    def encode(pending, tok, out, bar):
        raise _full()  # where the token ids are appended to the cache file

    datasets._encode = encode


if __name__ == "__main__":
    if "HANG_RANK" in os.environ:
        _hang(int(os.environ["HANG_RANK"]), int(os.environ["HANG_STEP"]),
              float(os.environ["HANG_S"]))
    fault = os.environ.get("ENOSPC")
    if fault == "metrics":
        _metrics(int(os.environ["ENOSPC_STEP"]))
    elif fault == "export":
        _export_shard(int(os.environ.get("ENOSPC_RANK", "0")))
    elif fault == "tokenizer":
        _atomic_writes_to("tokenizer.json")
    elif fault == "token-cache":
        _token_cache()
    console(sys.argv[1:], prog="fault_worker.py")
    distributed.exit_process(0)
