#!/bin/bash
# One device call: GPU tests of the kernels, both benchmarks, an ncu profile; logs under $OUT.
# Usage (device tool, carry .whl with the torchao wheel): bash tests/kernels/run_gpu.sh
#   STAGES=tests,qdq,ncu,moe (default: all)   QDQ_ARGS="--sweep" (extra bench_qdq flags)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  uname -r
  python3 -c "import torch, triton; p = torch.cuda.get_device_properties(0); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'SMs', p.multi_processor_count, 'L2 MB', p.L2_cache_size / 1e6)"
  python3 -c "import torchao; print('torchao', torchao.__version__)"; } 2>&1 | tee "$OUT/env.txt"
STAGES=${STAGES:-tests,qdq,ncu,moe}
if [[ $STAGES == *tests* ]]; then
  # every GPU test of the suite plus the kernel tests; no -x, so one failure hides no other
  timeout 200 python3 -m pytest tests/kernels tests/formats/test_nvfp4_gpu.py tests/model/test_model_gpu.py \
    -q -rfE -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -30
  # a kernel that hangs would hang every later stage too
  [ "${PIPESTATUS[0]}" = 124 ] && { echo "tests timed out: later stages skipped"; exit 124; }
fi
if [[ $STAGES == *qdq* ]]; then
  timeout 240 python3 jobs/bench_qdq.py ${QDQ_ARGS:-} 2>&1 | tee "$OUT/bench_qdq.log"
fi
if [[ $STAGES == *ncu* ]]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
    M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
    M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active
    M=$M,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
    timeout 150 "$NCU" --clock-control none --kernel-name "regex:nvfp4_kernel|mx_kernel|amax_kernel" \
      --launch-count 21 --metrics "$M" --print-units base --csv python3 jobs/bench_qdq.py --ncu-target \
      --shapes 8x4096x6144 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
    python3 - "$OUT/ncu.csv" <<'EOF' 2>&1 | tee "$OUT/ncu_table.txt"
import csv, sys
from collections import defaultdict
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("ncu wrote no rows (see ncu.err)")
h = rows[0]
K, M, V = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value")
I = h.index("ID")
by = defaultdict(dict)
names = {}
for r in rows[1:]:
    by[r[I]][r[M]] = r[V].replace(",", "")
    names[r[I]] = r[K][:14]
cols = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
        "lts__t_sector_hit_rate.pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "sm__warps_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"]
print("id  kernel          " + " ".join(c.split("__")[1].split(".")[0][:12].rjust(12) for c in cols))
for i in sorted(by, key=int):
    print(f"{i:<4}{names[i]:<16}" + " ".join(by[i].get(c, "-")[:12].rjust(12) for c in cols))
EOF
  else
    echo "ncu not found" | tee "$OUT/ncu_table.txt"
  fi
fi
if [[ $STAGES == *moe* ]]; then
  timeout 150 python3 jobs/bench_qat_moe.py --k3 --recipes bf16,mxfp4+mxfp8,nvfp4,nvfp4+mxfp8 \
    --iters 10 --profile 2>&1 | tee "$OUT/bench_qat_moe.log" | grep -v "^\s*$" | head -120
fi
