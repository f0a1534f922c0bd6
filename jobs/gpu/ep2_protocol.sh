#!/usr/bin/env bash
# The two-GPU expert-parallel QAT protocol, end to end in one command:
#   1. write a packed MXFP4 (compressed-tensors) checkpoint of a preset with real expert shapes
#   2. BF16 run, EP2, --init from that checkpoint through the DCP reader (per-rank load memory
#      probed first), N steps, DCP checkpoint
#   3. MXFP4 weights + MXFP8 activations QAT run, same init and data: SIGKILL mid-run (after the
#      step-N/2 checkpoint), resume in a fresh torchrun, finish, export compressed-tensors
#   4. report: export re-opened and compared with the DCP masters, resume overlap, fake-quant
#      share, budgets (workbench.track.compare), a summary table
#
#   jobs/gpu/ep2_protocol.sh                  # GPU: 2 ranks, NCCL, qwen3_30b_a3b_like experts
#   jobs/gpu/ep2_protocol.sh --cpu            # CPU: 2 ranks, gloo, the tiny preset (a dry run)
#   jobs/gpu/ep2_protocol.sh --nproc 1        # the same protocol on one GPU (EP1: every expert local)
#   jobs/gpu/ep2_protocol.sh --nproc 1 --deterministic   # bitwise resume on a GPU (docs/determinism.md)
#   options: --steps N  --work DIR  --out DIR  --layers L  --batch B  --seq S  --deadline SECONDS
#            --nproc N (ranks = GPUs, default 2)  --deterministic (every run with --deterministic)
#            --recipe R (the QAT run's recipe, default mxfp4+mxfp8; e.g. nvfp4, whose expert
#            stacks take the optimizer's fused update + amax on a GPU)
# Results go to --out (default $OUT, else ./out/ep2): summary.md, summary.json, protocol.log,
# runs.tar.gz (metrics.jsonl, configs, results, logs of every run; no checkpoints).
#
# On the device tool (one call, kind nvidia-h200-x2, no wheels to carry: the protocol imports
# neither torchao, wandb nor submitit; transformers, safetensors, pandas, tqdm are in the image):
#   run(kind="nvidia-h200-x2", timeout_s=600, command="bash jobs/gpu/ep2_protocol.sh")
# Expected wall time is a few minutes (estimate, not yet measured); --deadline (default 540 s on
# GPU) cuts later phases short so that the report still runs and comes back.
set -uo pipefail

MODE=gpu
START=$(date +%s)
STEPS=""; WORK=""; RESULTS="${OUT:-}"; LAYERS=2; BATCH=""; SEQ=""; NPROC=2; DETERMINISTIC=""
RECIPE=mxfp4+mxfp8
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --steps) STEPS="$2"; shift ;;
    --work) WORK="$2"; shift ;;
    --out) RESULTS="$2"; shift ;;
    --layers) LAYERS="$2"; shift ;;
    --batch) BATCH="$2"; shift ;;
    --seq) SEQ="$2"; shift ;;
    --deadline) DEADLINE="$2"; shift ;;
    --nproc) NPROC="$2"; shift ;;
    --deterministic) DETERMINISTIC=--deterministic ;;
    --recipe) RECIPE="$2"; shift ;;
    -h|--help) sed -n 2,25p "$0"; exit 0 ;;
    *) echo "ep2_protocol.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

# the recipe reaches command lines: a recipe name and nothing else (the trainer validates it)
if ! [[ $RECIPE =~ ^[a-z0-9_]+(:[a-z0-9_-]+)?(\+[a-z0-9_]+(:[a-z0-9_-]+)?)?$ ]]; then
  echo "ep2_protocol.sh: --recipe must be a recipe name such as mxfp4+mxfp8, got '$RECIPE'" >&2
  exit 2
fi

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
# Never let NCCL / PyTorch use NVLink multicast on the shared hosts (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Deterministic runs: the cuBLAS workspace setting in every rank's environment from its start
# (the trainer sets it too, but only once its Python runs).
if [ -n "$DETERMINISTIC" ]; then export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"; fi

if [ "$MODE" = gpu ]; then
  PRESET="qwen3_30b_a3b_like-L${LAYERS}-V256"
  STEPS="${STEPS:-200}"; BATCH="${BATCH:-16}"; SEQ="${SEQ:-1024}"
  LR=1e-3; WARMUP=20; VAL_EVERY=50
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"  # the DCP reader decodes on the CPU
  RUN_TIMEOUT=240
else
  PRESET=tiny
  STEPS="${STEPS:-24}"; BATCH="${BATCH:-8}"; SEQ="${SEQ:-64}"
  LR=3e-3; WARMUP=4; VAL_EVERY=8
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  RUN_TIMEOUT=240
fi
# Seconds from start by which everything, the report included, must be done: on GPU inside the
# device tool's 600 s per-command limit, so the summary always comes back.
if [ "$MODE" = gpu ]; then DEADLINE="${DEADLINE:-540}"; else DEADLINE="${DEADLINE:-900}"; fi
REPORT_RESERVE=60
HALF=$((STEPS / 2))
KILL_AT=$((HALF + 2 + (STEPS - HALF) / 10))  # a few steps past the step-HALF checkpoint
if [ -z "$WORK" ]; then
  # DCP checkpoints of the GPU preset are ~8 GB per rank: tmpfs when it is large enough.
  shm_gb=$(df -P -BG /dev/shm 2>/dev/null | awk 'NR==2 {gsub("G","",$4); print $4}')
  if [ "$MODE" = gpu ] && [ "${shm_gb:-0}" -ge 80 ]; then WORK=/dev/shm/ep2; else WORK=/tmp/ep2-$$; fi
fi
RESULTS="${RESULTS:-$REPO/out/ep2}"
rm -rf "$WORK"; mkdir -p "$WORK" "$RESULTS"
LOG="$RESULTS/protocol.log"
: > "$LOG"
PHASES="$WORK/phases.json"
echo "{}" > "$PHASES"
COMMAND="jobs/gpu/ep2_protocol.sh $([ "$MODE" = cpu ] && echo --cpu) --nproc $NPROC --steps $STEPS --layers $LAYERS --batch $BATCH --seq $SEQ${DETERMINISTIC:+ $DETERMINISTIC}"

say() { echo "[ep2 $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
left() { echo $(( START + DEADLINE - $(date +%s) )); }
phase() {  # phase NAME TIMEOUT CMD...: run, log, time; a failure is recorded and the protocol goes on
  local name="$1" limit="$2"; shift 2
  local t0 rc ms avail; t0=$(date +%s%N)
  # Keep REPORT_RESERVE seconds of the deadline for the report, which summarises whatever ran.
  [ "$name" = report ] && avail=$(left)
  [ "$name" != report ] && avail=$(( $(left) - REPORT_RESERVE ))
  if [ "$avail" -lt "$limit" ]; then limit=$avail; fi
  if [ "$limit" -lt 15 ]; then
    say "phase $name: skipped, ${limit}s left before the deadline"
    rc=125
  else
    say "phase $name (limit ${limit}s): $*"
    # tqdm bars (carriage-return lines) go to the log only, so the printed tail stays readable.
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG" | grep -av $'\r'
    rc=${PIPESTATUS[0]}
  fi
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  "$PY" - "$PHASES" "$name" "$rc" "$ms" <<'EOF'
import json, sys
p, name, rc, ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
d = json.load(open(p)); d[name] = {"rc": rc, "s": round(ms / 1000, 1)}; json.dump(d, open(p, "w"))
EOF
  say "phase $name: rc=$rc in ${ms} ms"
  return "$rc"
}

size_of() {  # size_of NAME PATH: bytes on disk, into sizes.json (checkpoint and export sizes)
  local b; b=$(du -sb "$2" 2>/dev/null | cut -f1)
  "$PY" -c 'import json,sys; p,n,b=sys.argv[1:]; d=json.load(open(p)); d[n]=int(b or 0); json.dump(d,open(p,"w"))' \
    "$WORK/sizes.json" "$1" "${b:-0}"
}
echo "{}" > "$WORK/sizes.json"

TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
DRIVER=jobs/gpu/ep2_driver.py
COMMON=(--preset "$PRESET" --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --lr "$LR"
        --warmup "$WARMUP" --val-every "$VAL_EVERY" --keep 1 --seed 0 --wandb disabled
        --init "$WORK/init" $DETERMINISTIC)

say "mode $MODE preset $PRESET steps $STEPS batch $BATCH seq $SEQ work $WORK results $RESULTS"
if [ "$MODE" = gpu ]; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
  nvidia-smi topo -m 2>&1 | tee -a "$LOG"
fi
phase write_init 300 "$PY" "$DRIVER" write-init --preset "$PRESET" --out "$WORK/init" --seed 1 \
  --env "$WORK/env.json"
if [ -f "$WORK/init/config.json" ]; then
  size_of init_bytes "$WORK/init"
  phase bf16 "$RUN_TIMEOUT" "${TORCHRUN[@]}" "$DRIVER" train --probe-load -- \
    "${COMMON[@]}" --recipe bf16 --ckpt-every 0 --out "$WORK/bf16"
  size_of bf16_dcp_bytes "$WORK/bf16/checkpoints"
  rm -rf "$WORK/bf16/checkpoints"  # not needed again; frees tmpfs memory for the QAT run
  phase qat_killed "$RUN_TIMEOUT" "$PY" "$DRIVER" kill-at --out "$WORK/qat" --step "$KILL_AT" \
    --timeout "$RUN_TIMEOUT" -- "${TORCHRUN[@]}" "$DRIVER" train -- \
    "${COMMON[@]}" --recipe "$RECIPE" --ckpt-every "$HALF" --out "$WORK/qat"
  phase qat_resumed "$RUN_TIMEOUT" "${TORCHRUN[@]}" "$DRIVER" train -- \
    "${COMMON[@]}" --recipe "$RECIPE" --ckpt-every "$HALF" --out "$WORK/qat" \
    --resume --export compressed-tensors
  size_of qat_dcp_bytes "$WORK/qat/checkpoints"
  size_of export_bytes "$WORK/qat/export"
fi
phase report 180 "$PY" jobs/gpu/ep2_report.py --work "$WORK" --out "$RESULTS" --command "$COMMAND"

# Small files only: metrics, configs, results, logs, probes (no checkpoints, no safetensors).
(cd "$WORK" && find . -maxdepth 2 -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \) \
   -print0 | tar --null -czf "$RESULTS/runs.tar.gz" -T -)
cp "$WORK/init/config.json" "$RESULTS/init_config.json" 2>/dev/null || true
say "results in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
if [ "${KEEP_WORK:-0}" != 1 ]; then rm -rf "$WORK"; fi
