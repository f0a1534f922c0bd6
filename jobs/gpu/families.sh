#!/usr/bin/env bash
# The model families on one H200, one command (each stage has its own time limit, the whole
# under the device tool's 600 s):
#   tests  tests/model/test_families_gpu.py: every family's model on CUDA against the CPU model
#          (fp32 logits, loss, gradients) and a bf16-autocast step         -> $OUT/tests.log
#   moe    jobs/bench_qat_moe.py --preset P --optimizer: one expert layer of each family's shape
#          (gpt-oss: clamped SwiGLU and biases), QAT vs BF16 on the fwd+bwd span
#                                                   -> $OUT/moe-P/bench_qat_moe.{log,json}
#   train  jobs/bench_train_gpu.py --preset P: the trainer step per family preset (a few layers),
#          QAT/BF16 per recipe                       -> $OUT/train-P/bench_train_gpu.log
# Usage (device tool, kind nvidia-h200, nothing to carry):
#   bash jobs/gpu/families.sh
#   STAGES=train PRESETS=gpt_oss_20b_like bash jobs/gpu/families.sh
#   DRY_RUN=cpu bash jobs/gpu/families.sh       # every stage at CPU sizes (the tiny_* presets)
set -uo pipefail
JOB_NAME=families
source "$(dirname "$0")/_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 WANDB_MODE=disabled
STAGES=${STAGES:-tests,moe,train}
PRESETS=${PRESETS:-gpt_oss_20b_like,deepseek_v3_like,kimi_k2_like}
MOE_ARGS=(--optimizer --iters 20); TRAIN=(--steps 12 --warmup 4 --batch 4 --seq 2048 --recipes mxfp4,nvfp4,mxfp4+mxfp8)
MOE_T=80; TRAIN_T=${TRAIN_T:-150}
if [ "${DRY_RUN:-}" = cpu ]; then
  PRESETS=${PRESETS_CPU:-tiny_gpt_oss,tiny_deepseek,tiny_glm}
  MOE_ARGS=(--experts 2 --iters 1 --recipes bf16,mxfp4); MOE_T=900
  TRAIN=(--steps 3 --warmup 1 --batch 2 --seq 32 --recipes mxfp4); TRAIN_T=900
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  git log --oneline -1 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"

if [[ $STAGES == *tests* ]]; then
  stamp "tests"
  timeout 120 "$PY" -m pytest tests/model/test_families_gpu.py -q -rfE -p no:cacheprovider 2>&1 \
    | tee "$OUT/tests.log" | tail -8
fi
for p in ${PRESETS//,/ }; do
  if [[ $STAGES == *moe* ]]; then
    stamp "bench_qat_moe --preset $p ${MOE_ARGS[*]}"
    mkdir -p "$OUT/moe-$p"
    OUT="$OUT/moe-$p" timeout "$MOE_T" "$PY" jobs/bench_qat_moe.py --preset "$p" "${MOE_ARGS[@]}" \
      2>&1 | tee "$OUT/moe-$p/bench_qat_moe.log" | grep -v "^\s*$"
  fi
  if [[ $STAGES == *train* ]]; then
    stamp "bench_train_gpu --preset $p ${TRAIN[*]}"
    mkdir -p "$OUT/train-$p"
    OUT="$OUT/train-$p" timeout "$TRAIN_T" "$PY" jobs/bench_train_gpu.py --preset "$p" "${TRAIN[@]}" \
      2>&1 | tee "$OUT/train-$p/bench_train_gpu.log" | grep -av $'\r' | tail -12
  fi
done
stamp "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
