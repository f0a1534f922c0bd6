"""Where the kernels plug in, checked without a GPU: CPU tensors keep the reference path (and
say so once), and importing the codecs or the kernels package loads no Triton."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

from workbench import formats as F
from workbench.qat import fake_quant_reference, ste


def test_cpu_tensors_take_the_reference_path_and_log_it_once(caplog):
    ste._LOGGED.discard(("mxfp4", "floor", "reference"))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    r = F.parse_recipe("mxfp4:floor")
    with caplog.at_level(logging.INFO, logger="workbench.qat.ste"):
        a = fake_quant_reference(x, r)
        b = fake_quant_reference(x, r)
    msgs = [m.getMessage() for m in caplog.records if "mxfp4:floor" in m.getMessage()]
    assert msgs == ["fake quantization mxfp4:floor on cpu: reference path"]
    assert torch.equal(a, F.fake_quantize(x, r)) and torch.equal(a, b)


def test_imports_load_no_triton():
    code = ("import sys, workbench.formats, workbench.kernels, workbench.qat; "
            "print(sorted(m for m in ('triton', 'matplotlib', 'wandb', 'submitit') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
