#!/usr/bin/env bash
# The trainer step at the shape of a real QAT run on one GPU, one command (each stage has its
# own time limit, the whole under the device tool's 600 s):
#   table      jobs/bench_step_gpu.py: the Qwen3-30B-A3B-shaped preset (4 layers, seq 4096, the
#              largest batch that fits), BF16 and every QAT recipe compiled, deterministic and
#              not, interleaved, MFU table, a kernel profile  -> $OUT/table/bench_step_gpu.{md,json}
#   selective  the same shape with selective activation checkpointing (the outputs of the GEMMs
#              and attention kept), 16 sequences (SEL_BATCH), every recipe deterministic off,
#              BF16 and NVFP4+MXFP8 on                       -> $OUT/selective/...
#   gptoss     the gpt-oss-20b-shaped preset (2 layers, GPTOSS_LAYERS), selective, 8 sequences,
#              BF16, MXFP4 and NVFP4+MXFP8
#                                                             -> $OUT/gptoss/...
#   ep1        the EP1 protocol in deterministic mode: bitwise resume after SIGKILL, and its cost
#                                                             -> $OUT/ep1/
# Usage (device tool, nothing to carry):
#   bash jobs/gpu/step_speed.sh
#   STAGES=table,selective bash jobs/gpu/step_speed.sh; STAGES=gptoss,ep1 bash ...  # two calls
#                              (every stage working can outlast one 600 s call on an H200)
#   STAGES=selective ROUNDS=4 PROFILE=1 bash jobs/gpu/step_speed.sh
#   DRY_RUN=cpu bash jobs/gpu/step_speed.sh     # every stage at CPU sizes (the tiny presets)
set -uo pipefail
JOB_NAME=step_speed
source "$(dirname "$0")/_env.sh"
export WANDB_MODE=disabled
STAGES=${STAGES:-table,selective,gptoss,ep1}
ROUNDS=${ROUNDS:-3}
SHAPE=(--batch 32,16,8 --rounds "$ROUNDS" --steps 2 --profile "${PROFILE:-1}")
T=${T:-240}; QWEN=qwen3_30b_a3b_like; GPTOSS=gpt_oss_20b_like; SEL=${SEL_BATCH:-16}
if [ "${DRY_RUN:-}" = cpu ]; then  # the small presets: the real shapes' experts alone exceed a CPU box
  SHAPE=(--cpu --batch 2 --seq 64 --layers 1 --rounds 2 --steps 1 --profile "${PROFILE:-1}")
  T=900; QWEN=tiny; GPTOSS=tiny_gpt_oss; SEL=${SEL_BATCH:-2}
fi
DET=bf16@compile,mxfp4@compile,nvfp4@compile,mxfp4+mxfp8@compile,nvfp4+mxfp8@compile
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 \
  | tee "$OUT/env.txt"

bench() {  # NAME ARGS...: one bench_step_gpu run into $OUT/NAME, the table on stdout
  local name=$1; shift
  mkdir -p "$OUT/$name"
  stamp "bench_step_gpu $name: $*"
  OUT="$OUT/$name" timeout "$T" "$PY" jobs/bench_step_gpu.py "$@" 2>&1 | grep -av $'\r' \
    | tee "$OUT/$name/log.txt" | tail -20
}
if [[ $STAGES == *table* ]]; then
  bench table "${SHAPE[@]}" --preset "$QWEN" \
    --configs "$DET,bf16@compile@no-det,nvfp4+mxfp8@compile@no-det"
fi
# every recipe with deterministic mode off (the throughput a run gets), then BF16 and one recipe
# with it on (what the bit-exact protocol costs); each row is compared with BF16 in its own mode
NODET=bf16@compile@no-det,mxfp4@compile@no-det,nvfp4@compile@no-det
NODET=$NODET,mxfp4+mxfp8@compile@no-det,nvfp4+mxfp8@compile@no-det
if [[ $STAGES == *selective* ]]; then
  bench selective "${SHAPE[@]}" --batch "$SEL" --preset "$QWEN" --act-ckpt selective \
    --configs "$NODET,bf16@compile,nvfp4+mxfp8@compile"
fi
if [[ $STAGES == *gptoss* ]]; then
  # 2 layers: at 4 the fp32 masters, gradients and AdamW moments (16 B x 4.4B) fill an H100
  OSS=(--batch "$(( (SEL + 1) / 2 )),$(( (SEL + 3) / 4 ))")
  [ "${DRY_RUN:-}" = cpu ] || OSS+=(--layers "${GPTOSS_LAYERS:-2}")
  bench gptoss "${SHAPE[@]}" "${OSS[@]}" --preset "$GPTOSS" --act-ckpt selective \
    --configs bf16@compile@no-det,mxfp4@compile@no-det,nvfp4+mxfp8@compile@no-det,bf16@compile
fi
if [[ $STAGES == *ep1* ]]; then
  stamp "EP1 protocol (deterministic)"
  # the protocol fits its late phases into what is left of this job's ~585 s
  STAGES=ep2 DRY_RUN="${DRY_RUN:-}" EP1_LEFT=$(( 585 - ($(date +%s) - START) )) OUT="$OUT" \
    bash jobs/gpu/qat_trainer.sh 2>&1 | tail -25
fi
stamp "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
