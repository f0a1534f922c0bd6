"""One rank of the two-rank fault tests (test_resume_faults.py); RANK/WORLD_SIZE/MASTER_* in env.

    resume_fault_worker.py cli ARGS...   jobs/qat.py's entry point; with ENOSPC_STEP=N, the
                                         DCP writer of rank ENOSPC_RANK fails "No space left on
                                         device" on the checkpoint of step N
    resume_fault_worker.py api OUT       checkpointing.load (no digest check) on damaged copies
                                         of OUT's step-4 checkpoint, and into a model of another
                                         preset; prints "RESULT case ExceptionType message"
"""

import errno
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import filesystem

from workbench.train import checkpointing as ckpt
from workbench.train import distributed
from workbench.train.build import build
from workbench.train.cli import cli
from workbench.train.config import preset_config


class _FullDisk:
    def __init__(self, stream, path):
        self._stream, self._path = stream, path

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _inject_enospc(step: int, rank: int) -> None:
    real = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            if (f".tmp-step_{step:08d}" in str(path) and "w" in mode
                    and int(os.environ["RANK"]) == rank):
                yield _FullDisk(stream, path)
            else:
                yield stream

    filesystem.FileSystem.create_stream = create_stream


def _api(out: Path) -> None:
    info = distributed.setup()
    src = ckpt.list_complete(out)[0]
    cases = {"preset-mismatch": "small", "truncated-distcp": "tiny", "garbled-distcp": "tiny",
             "garbage-metadata": "tiny", "missing-metadata": "tiny"}
    for case, preset in cases.items():
        work = out.parent / f"api-{case}"
        folder = ckpt.checkpoint_root(work) / src.path.name
        if info.is_main:
            shutil.copytree(src.path, folder)
            if case == "truncated-distcp":
                f = sorted(folder.glob("*.distcp"))[-1]
                with open(f, "r+b") as fh:
                    fh.truncate(f.stat().st_size // 2)
            elif case == "garbled-distcp":  # sizes intact: only torch.load inside DCP sees it
                f = sorted(folder.glob("*.distcp"))[-1]
                with open(f, "r+b") as fh:
                    fh.write(b"\xff" * 64)
            elif case == "garbage-metadata":
                (folder / ".metadata").write_bytes(b"\x80\x04garbage" * 50)
            elif case == "missing-metadata":
                (folder / ".metadata").unlink()
        distributed.barrier(info)
        cfg = preset_config(preset, str(work), batch=4, seq=32, resume=True)
        b = build(cfg, info, resuming=True)
        found = ckpt.Found(src.step, folder, src.meta)
        try:
            ckpt.load(found, b.model, b.opt, b.sched, info)
            print(f"RESULT {case} loaded -", flush=True)
        except ckpt.CheckpointError as e:
            print(f"RESULT {case} {type(e).__name__} {e}".replace("\n", " "), flush=True)
    distributed.teardown(info)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "cli":
        if "ENOSPC_STEP" in os.environ:
            _inject_enospc(int(os.environ["ENOSPC_STEP"]), int(os.environ["ENOSPC_RANK"]))
        cli(args)
    else:
        _api(Path(args[0]))
    distributed.exit_process(0)  # as the trainer's entry points end (see its docstring)
