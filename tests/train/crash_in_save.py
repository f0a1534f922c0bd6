"""Fault injection: run jobs/qat.py's main, SIGKILL this process right after DCP has written the
files of the checkpoint at step CRASH_STEP, before the trainer marks it complete and renames it."""

import os
import signal
import sys

import torch.distributed.checkpoint as dcp

from workbench.train import checkpointing
from workbench.train.cli import main

crash_step = int(os.environ["CRASH_STEP"])
real_save = dcp.save


def save_then_die(state_dict, *, checkpoint_id, **kw):
    real_save(state_dict, checkpoint_id=checkpoint_id, **kw)
    if checkpoint_id.endswith(f"step_{crash_step:08d}"):
        os.kill(os.getpid(), signal.SIGKILL)


checkpointing.dcp.save = save_then_die
main(sys.argv[1:])
