#!/bin/bash
# One device call: GPU tests of the kernels, then both benchmarks; logs under $OUT.
# Usage (device tool, carry .whl with the torchao wheel): bash tests/kernels/run_gpu.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)"; } 2>&1 | tee "$OUT/env.txt"
STAGES=${STAGES:-tests,qdq,moe}
if [[ $STAGES == *tests* ]]; then
  timeout 110 python3 -m pytest tests/kernels -q -rfE -p no:cacheprovider -x 2>&1 | tee "$OUT/tests.log" | tail -25
fi
if [[ $STAGES == *qdq* ]]; then
  timeout 150 python3 jobs/bench_qdq.py ${QDQ_ARGS:-} 2>&1 | tee "$OUT/bench_qdq.log"
fi
if [[ $STAGES == *moe* ]]; then
  timeout 110 python3 jobs/bench_qat_moe.py --k3 --recipes bf16,mxfp4+mxfp8 --iters 10 --profile 2>&1 \
    | tee "$OUT/bench_qat_moe.log" | grep -v "^\s*$" | head -120
fi
