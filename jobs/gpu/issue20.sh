#!/usr/bin/env bash
# Issue 20 on one H200, one command: the stack readers of the batched analysis path side by side
# in ONE run, so the new reader is measured against its own baseline on the same files:
#   tests   the GPU analysis tests and the reader tests (tests/analysis/test_fast_gpu.py,
#           tests/checkpoint/test_read_into.py, tests/analysis/test_read_into_stacks.py)
#                                                                   -> $OUT/tests.log
#   bench   jobs/bench_analysis.py --size-gb $SIZE_GB --cleanup --formats mxfp4 --questions
#           stored_vs_recipes,candidate_errors --readers safetensors,preadv: one 15 GB MXFP4
#           checkpoint, one plain sequential read, then per question a fresh process per reader
#           (WORKBENCH_ANALYSIS_READER=safetensors: stored_grid per member + torch.stack + pinned
#           copy; =preadv: read_into straight into pinned stacks), two calls each, cold page
#           cache each, the tables of the two readers compared   -> $OUT/bench_analysis.{md,log}
# Usage (device tool, kind nvidia-h200, nothing to carry: the analysis imports no torchao):
#   bash jobs/gpu/issue20.sh
#   SIZE_GB=6 bash jobs/gpu/issue20.sh        # smaller, if the 540 s of a call are short
#   STAGES=bench bash jobs/gpu/issue20.sh     # the benchmark alone
#   STAGES=profile bash jobs/gpu/issue20.sh   # where a pass's time goes (jobs/gpu/analysis_profile.py,
#                                             # about 4 minutes at 15 GB)  -> $OUT/analysis_profile.md
# Time, estimated from the README run of the old path (15.1 GB, read 1.57 GB/s, calls of
# 17-30 s): ~15 s to write, ~10 s to read, 2 questions x 2 readers x 2 calls of <= 30 s: about
# 3-5 minutes; the bench writes its table after each format, so a cut run still leaves it.
set -uo pipefail
JOB_NAME=issue20
source "$(dirname "$0")/_env.sh"
STAGES=${STAGES:-tests,bench}
SIZE_GB=${SIZE_GB:-15}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc; df -h /tmp | tail -1
  "$PY" -c "import torch, safetensors; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'safetensors', safetensors.__version__)"
  git log --oneline -1 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"

if [[ $STAGES == *tests* ]]; then
  stamp "tests"
  timeout 75 "$PY" -m pytest -q -p no:cacheprovider tests/analysis/test_fast_gpu.py \
    tests/checkpoint/test_read_into.py tests/analysis/test_read_into_stacks.py 2>&1 \
    | tail -20 | tee "$OUT/tests.log"
fi
if [[ $STAGES == *bench* ]]; then
  stamp "bench ($SIZE_GB GB)"
  timeout 440 "$PY" jobs/bench_analysis.py --size-gb "$SIZE_GB" --cleanup --formats mxfp4 \
    --questions stored_vs_recipes,candidate_errors --readers safetensors,preadv --out "$OUT" \
    2>&1 | tee "$OUT/bench_analysis.log"
fi
if [[ $STAGES == *profile* ]]; then
  stamp "profile ($SIZE_GB GB)"
  timeout 440 "$PY" jobs/gpu/analysis_profile.py --size-gb "$SIZE_GB" --out "$OUT" 2>&1 \
    | grep -av $'\r' | tee "$OUT/analysis_profile.log" | tail -20
fi
stamp "done"
