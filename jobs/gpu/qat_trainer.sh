#!/usr/bin/env bash
# QAT kernels, expert layer, trainer and EP1 protocol on one H200, one command (about 8 minutes; every stage has its own time limit so the
# whole stays under the device tool's 600 s):
#   tests  the GPU tests of the QAT path (amax book + one-pass quantize, the grouped fast
#          path, the model's CUDA tests) and the CPU tests of the amax book and the atomic-free
#          combine (the full kernel suite: tests/kernels/run_gpu.sh)       -> $OUT/tests.log
#   bits   jobs/gpu/swiglu_bits.py: the fused SwiGLU kernels against torch's CUDA ops, every
#          bf16 gate value (and which CONTRACT is torch's silu_backward)  -> $OUT/swiglu_bits.log
#          jobs/gpu/adamw_bits.py: the fused AdamW kernels' rounding switches against torch's
#          CUDA AdamW (the last op's CONTRACT, every whole-step combination) -> $OUT/adamw_bits.log
#   moe    jobs/bench_qat_moe.py --k3: QAT expert layer vs BF16, three variants (MOE_VARIANTS):
#          plain (one-element weight update), optimizer (--optimizer: AdamW each step, goal on the
#          fwd+bwd span), fp32 (--optimizer --masters fp32)
#                                                  -> $OUT/moe-VARIANT/bench_qat_moe.{log,json}
#   train  jobs/bench_train_gpu.py: trainer table (tokens/s/GPU, MFU, peak memory, fq share,
#          QAT/BF16) for bf16 and each recipe, deterministic on/off cost, two fresh seeded runs
#          compared (deterministic and not)                -> $OUT/bench_train_gpu.{log,json,md}
#   ep2    jobs/gpu/ep2_protocol.sh --nproc 1 --deterministic: bitwise resume on the GPU
#                                                          -> $OUT/ep1/summary.md (+ its files)
# Usage (device tool, kind nvidia-h200, nothing to carry: no torchao, wandb or submitit needed):
#   bash jobs/gpu/qat_trainer.sh
#   STAGES=ep2 bash jobs/gpu/qat_trainer.sh          # the resume check alone, if the first call ran out
#   STAGES=moe,train bash jobs/gpu/qat_trainer.sh    # a subset; EP1_STEPS / TRAIN_ARGS override sizes
#   STAGES=train TRAIN_T=400 TRAIN_ARGS="--swiglu-ab --profile 3" bash jobs/gpu/qat_trainer.sh
#                                                # the fused SwiGLU's trainer A/B with kernel times
#   DRY_RUN=cpu bash jobs/gpu/qat_trainer.sh         # every stage at CPU sizes (tiny preset, --cpu)
set -uo pipefail
JOB_NAME=qat_trainer
source "$(dirname "$0")/_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 WANDB_MODE=disabled
STAGES=${STAGES:-tests,bits,moe,train,ep2}
MOE_VARIANTS=${MOE_VARIANTS:-plain,optimizer,fp32}
MOE_ARGS=(--k3 --iters 30 --breakdown); TRAIN=(${TRAIN_ARGS:-}); EP1=(); TESTS_T=200
if [ "${DRY_RUN:-}" = cpu ]; then
  MOE_ARGS=(--experts 4 --hidden 128 --ffn 64 --tokens-per-expert 32 --iters 2)
  TRAIN=(--preset tiny --steps 4 --warmup 1 --batch 4 --seq 32 ${TRAIN_ARGS:-})
  EP1=(--cpu); TESTS_T=600; EP1_STEPS=${EP1_STEPS:-12}
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  uname -r
  "$PY" -c "import torch, triton; p = torch.cuda.get_device_properties(0); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'SMs', p.multi_processor_count)"
  git log --oneline -1 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"

if [[ $STAGES == *tests* ]]; then
  stamp "tests"
  timeout "$TESTS_T" "$PY" -m pytest tests/kernels/test_amax_cache_gpu.py tests/kernels/test_grouped_gpu.py \
    tests/kernels/test_swiglu.py tests/kernels/test_codecs.py tests/kernels/test_dispatch.py tests/model/test_model_gpu.py tests/qat/test_amax_book.py \
    tests/train/test_deterministic_combine.py tests/train/test_optim_gpu.py tests/kernels/test_sumsq.py tests/model/test_cast.py \
    tests/model/test_linear_cross_entropy.py -q -rfE -p no:cacheprovider 2>&1 \
    | tee "$OUT/tests.log" | tail -15
  # every other GPU-marked test of the QAT path
  timeout 120 "$PY" -m pytest -m gpu tests/qat tests/train/test_fsdp.py -q -rfE -p no:cacheprovider 2>&1 \
    | tee -a "$OUT/tests.log" | tail -5
fi
if [[ $STAGES == *bits* ]] && [ "${DRY_RUN:-}" != cpu ]; then
  stamp "swiglu_bits"
  timeout 60 "$PY" jobs/gpu/swiglu_bits.py 2>&1 | tee "$OUT/swiglu_bits.log"
  stamp "adamw_bits"
  timeout 120 "$PY" jobs/gpu/adamw_bits.py 2>&1 | tee "$OUT/adamw_bits.log"
fi
if [[ $STAGES == *moe* ]]; then
  for variant in ${MOE_VARIANTS//,/ }; do
    case $variant in
      plain) extra=() ;;
      optimizer) extra=(--optimizer) ;;
      fp32) extra=(--optimizer --masters fp32) ;;
      *) echo "qat_trainer.sh: unknown MOE_VARIANTS entry '$variant'" >&2; exit 2 ;;
    esac
    stamp "bench_qat_moe ${MOE_ARGS[*]} ${extra[*]}"
    mkdir -p "$OUT/moe-$variant"
    OUT="$OUT/moe-$variant" timeout 90 "$PY" jobs/bench_qat_moe.py "${MOE_ARGS[@]}" "${extra[@]}" \
      2>&1 | tee "$OUT/moe-$variant/bench_qat_moe.log" | grep -v "^\s*$"
  done
fi
if [[ $STAGES == *train* ]]; then
  stamp "bench_train_gpu"
  # tqdm bars (carriage returns) stay in the log only
  timeout "${TRAIN_T:-210}" "$PY" jobs/bench_train_gpu.py "${TRAIN[@]}" 2>&1 | tee "$OUT/bench_train_gpu.log" \
    | grep -av $'\r'
fi
if [[ $STAGES == *ep2* ]]; then
  stamp "ep2_protocol --nproc 1 --deterministic"
  # what is left of ~580 s, less the report's share (the protocol cuts late phases to fit)
  left=${EP1_LEFT:-$(( 580 - ($(date +%s) - START) ))}  # EP1_LEFT: a calling job's own share
  [ "$left" -lt 150 ] && left=150
  [ "${DRY_RUN:-}" = cpu ] && left=900
  PYTHON="$PY" bash jobs/gpu/ep2_protocol.sh "${EP1[@]}" --nproc 1 --deterministic --steps "${EP1_STEPS:-60}" \
    --deadline "$left" --out "$OUT/ep1" 2>&1 | grep -av $'\r' | tail -25
fi
stamp "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
