"""QAT training job: a thin wrapper over `workbench.train.cli.main` (see its --help).

    torchrun --nproc-per-node 4 jobs/qat.py --preset tiny --recipe mxfp4 --steps 20 --out runs/x
    python jobs/qat.py --preset tiny --recipe bf16 --steps 20 --out runs/y      # one process
"""

import os
import sys

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workbench.train.cli import entry

if __name__ == "__main__":
    entry()
