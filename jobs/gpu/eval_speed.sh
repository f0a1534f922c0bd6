#!/usr/bin/env bash
# Downstream-eval throughput on one GPU, one command: jobs/bench_eval.py on a 4-layer
# Qwen3-30B-A3B-shaped model, as a BF16 checkpoint and as a packed MXFP4 compressed-tensors
# export through lm-eval's HF backend, and the PTQ model through the workbench
#                                                         -> $OUT/bench_eval.{log,json}
# A GPU image without the eval extra needs its packages as wheels in .whl/ (installed here into
# /tmp/site, nothing else touched). Fetch them where pip reaches an index (Python 3.12, x86-64):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .whl lm-eval==0.4.13 datasets evaluate dill multiprocess \
#     pytablewriter dataproperty mbstrdecoder typepy tabledata tcolorpy pathvalidate chardet \
#     nltk defusedxml more-itertools httpx2 httpcore2 truststore tzdata compressed-tensors \
#     pydantic pydantic-core annotated-types typing-inspection loguru transformers huggingface_hub
#   pip wheel --no-deps -w .whl rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1   # sdists
# Usage:  bash jobs/gpu/eval_speed.sh            LAYERS=2 DOCS=64 bash jobs/gpu/eval_speed.sh
#         DRY_RUN=cpu bash jobs/gpu/eval_speed.sh   # the tiny preset on the CPU, this venv's packages
set -uo pipefail
JOB_NAME=eval_speed
source "$(dirname "$0")/_env.sh"
export WANDB_MODE=disabled
ARGS=(--layers "${LAYERS:-4}" --docs "${DOCS:-256}")
if [ "${DRY_RUN:-}" = cpu ]; then
  ARGS=(--preset tiny --device cpu --docs 8 --gen-docs 4)
elif compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
"$PY" -c "import lm_eval, compressed_tensors" 2>/dev/null \
  || { echo "error: lm-eval or compressed-tensors is not importable (see the wheels above)"; exit 2; }
stamp "bench_eval ${ARGS[*]}"
OUT="$OUT" timeout "${EVAL_T:-500}" "$PY" jobs/bench_eval.py "${ARGS[@]}" --out /tmp/bench_eval 2>&1 | grep -av $'\r' | tee "$OUT/bench_eval.log" | tail -16
cp /tmp/bench_eval/bench_eval.json "$OUT/" 2>/dev/null
stamp "done"
