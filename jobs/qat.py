"""QAT training job: a thin wrapper over `workbench.train.cli.main` (see its --help).

    torchrun --nproc-per-node 4 jobs/qat.py --preset tiny --recipe mxfp4 --steps 20 --out runs/x
    python jobs/qat.py --preset tiny --recipe bf16 --steps 20 --out runs/y      # one process
"""

import os
import sys

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workbench.train.cli import cli
from workbench.train.distributed import exit_process

if __name__ == "__main__":
    cli()  # main(), with a refused resume or a bad checkpoint as one line and exit code 2
    exit_process(0)  # without finalisation while gloo threads are alive (FSDP): see its docstring
