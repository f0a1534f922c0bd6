#!/usr/bin/env bash
# Per-expert analysis speed on one H200, one command: the stack readers of the batched analysis path side by side
# in ONE run, so the default reader is measured against its own baseline on the same files:
#   tests   the GPU analysis tests and the reader tests (tests/analysis/test_fast_gpu.py,
#           tests/checkpoint/test_read_into.py, tests/checkpoint/test_stacks.py)
#                                                                   -> $OUT/tests.log
#   bench   jobs/bench_analysis.py --size-gb $SIZE_GB --cleanup --formats mxfp4 --questions
#           stored_vs_recipes,candidate_errors --readers $READERS: one 15 GB MXFP4 checkpoint,
#           one plain sequential read, then per question a fresh process per reader
#           (the plan's reader preadv: read_into per member straight into pinned stacks;
#           window: each shard read front to back in 512 MiB spans, stacks cut on the device),
#           two calls each, cold page cache each, the tables of the readers compared
#                                                                   -> $OUT/bench_analysis.{md,log}
#   formats the other formats with the default reader: NVFP4 and MXFP8 (stored vs recipes,
#           candidate recipes)                                      -> $OUT/formats/
#   reference  the third question, both readers: MXFP4 against its BF16 reference, $REF_GB GB
#           of BF16 (12: a 15 GB pair, 10 layers)                   -> $OUT/reference/
# Usage (device tool, kind nvidia-h200, nothing to carry: the analysis imports no torchao):
#   bash jobs/gpu/analysis_speed.sh                  # tests + bench (~6 minutes at 15 GB)
#   STAGES=formats bash jobs/gpu/analysis_speed.sh   # ~3 minutes at 15 GB
#   STAGES=tests,reference bash jobs/gpu/analysis_speed.sh   # ~3 minutes
#   SIZE_GB=6 bash jobs/gpu/analysis_speed.sh        # smaller, if the 540 s of a call are short
#   STAGES=profile bash jobs/gpu/analysis_speed.sh   # where a pass's time goes (jobs/gpu/analysis_profile.py,
#                                             # about 4 minutes at 15 GB)  -> $OUT/analysis_profile.md
#   STAGES=profile-reference bash jobs/gpu/analysis_speed.sh  # the same for reference errors (~3 minutes)
#                                             # -> $OUT/analysis_profile_reference.md
# Time, from the 2026-12-03 run (15.1 GB, read 1.27 GB/s, calls of 17-30 s): ~15 s to write, ~10 s
# to read, 2 questions x 2 readers x 2 calls of <= 30 s: about 5 minutes; the bench writes its
# table after each format, so a cut run still leaves it.
set -uo pipefail
JOB_NAME=analysis_speed
source "$(dirname "$0")/_env.sh"
STAGES=${STAGES:-tests,bench}
SIZE_GB=${SIZE_GB:-15}
READERS=${READERS:-preadv,window}
REF_GB=${REF_GB:-12}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc; df -h /tmp | tail -1
  "$PY" -c "import torch, safetensors; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'safetensors', safetensors.__version__)"
  git log --oneline -1 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"

if [[ $STAGES == *tests* ]]; then
  stamp "tests"
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/analysis/test_fast_gpu.py \
    tests/checkpoint/test_read_into.py tests/checkpoint/test_stacks.py 2>&1 \
    | tail -20 | tee "$OUT/tests.log"
fi
if [[ $STAGES == *bench* ]]; then
  stamp "bench ($SIZE_GB GB)"
  timeout 440 "$PY" jobs/bench_analysis.py --size-gb "$SIZE_GB" --cleanup --formats mxfp4 \
    --questions stored_vs_recipes,candidate_errors --readers "$READERS" --out "$OUT" \
    2>&1 | tee "$OUT/bench_analysis.log"
fi
if [[ $STAGES == *formats* ]]; then
  stamp "formats ($SIZE_GB GB)"
  mkdir -p "$OUT/formats"
  timeout 400 "$PY" jobs/bench_analysis.py --size-gb "$SIZE_GB" --cleanup \
    --formats nvfp4,mxfp8_e4m3 --questions stored_vs_recipes,candidate_errors \
    --out "$OUT/formats" 2>&1 | tee "$OUT/formats/bench_analysis.log"
fi
if [[ $STAGES == *reference* ]]; then
  stamp "reference errors ($REF_GB GB of BF16 + its MXFP4)"
  mkdir -p "$OUT/reference"
  timeout 400 "$PY" jobs/bench_analysis.py --size-gb "$REF_GB" --ref-gb "$REF_GB" --cleanup \
    --formats mxfp4 --questions reference_errors --readers "$READERS" --out "$OUT/reference" \
    2>&1 | tee "$OUT/reference/bench_analysis.log"
fi
if [[ $STAGES == *profile-reference* ]]; then
  stamp "profile of reference errors ($SIZE_GB GB pair)"
  timeout 440 "$PY" jobs/gpu/analysis_profile.py --question reference --size-gb "$SIZE_GB" \
    --out "$OUT" 2>&1 | grep -av $'\r' | tee "$OUT/analysis_profile_reference.log" | tail -12
elif [[ $STAGES == *profile* ]]; then
  stamp "profile ($SIZE_GB GB)"
  timeout 440 "$PY" jobs/gpu/analysis_profile.py --size-gb "$SIZE_GB" --out "$OUT" 2>&1 \
    | grep -av $'\r' | tee "$OUT/analysis_profile.log" | tail -20
fi
stamp "done"
