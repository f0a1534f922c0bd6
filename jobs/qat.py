"""QAT training job for torchrun: a thin wrapper over `workbench.train.cli` (see its --help).

    torchrun --nproc-per-node 4 jobs/qat.py --preset tiny --recipe mxfp4 --steps 20 --out runs/x
    torchrun --nproc-per-node 4 -m workbench.train.cli ...        # the same, without this file
    workbench train --preset tiny --recipe bf16 --steps 20 --out runs/y      # one process

`workbench` is imported as installed (`pip install -e .`, or PYTHONPATH for another checkout).
"""

import os

# torchao (an optional dependency transformers may import) skips its compiled extensions, which
# are built for another torch.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from workbench.train.cli import console

if __name__ == "__main__":
    console(prog="jobs/qat.py")
