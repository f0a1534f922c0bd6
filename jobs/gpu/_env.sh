# Sourced by the one-command GPU jobs (qat_trainer.sh, analysis_speed.sh, families.sh, step_speed.sh), after `set -uo pipefail`: the
# output folder ($OUT, which the device tool provides), the repository as the working folder and
# on PYTHONPATH (nothing installed on the device image), and `stamp`, a line per stage with the
# seconds since the job began. The caller sets JOB_NAME.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY=${PYTHON:-python3}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
START=$(date +%s)
stamp() { echo "[$JOB_NAME +$(( $(date +%s) - START ))s] $*"; }
