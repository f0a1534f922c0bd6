#!/usr/bin/env bash
# `make lab`: the workbench in JupyterLab, for a user on their own machine.
#
#   make lab                            # or: bash jobs/lab.sh [extra jupyter lab options]
#   LAB_PORT=8899 make lab              # another port (default 8888, the next free one if taken)
#   LAB_NO_DEMO=1 make lab              # skip building the embedded demo checkpoint
#   LAB_NOTEBOOK=notebooks/02_launch_qat.ipynb make lab
#
# 1. builds the embedded demo checkpoint once (workbench.demo: minutes on a laptop CPU, then
#    cached in runs/demo), so 01_inspect_checkpoint runs as it opens with its default parameters;
# 2. starts JupyterLab on localhost over the repository, with the venv's Python as the kernel,
#    opens the notebook, and prints the URL (with its token) to paste into a browser.
# The kernel's working folder is the notebook's (notebooks/); WORKBENCH_DEMO_DIR is exported as an
# absolute path so the notebooks find the same demo checkpoint as `make demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "no .venv here: run \`make lab\` (it installs) or \`make venv\` first" >&2; exit 1; }
export WORKBENCH_DEMO_DIR="${WORKBENCH_DEMO_DIR:-$ROOT/runs/demo}"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONUNBUFFERED=1
export PATH="$ROOT/.venv/bin:$PATH"   # terminals and kernels JupyterLab starts use the venv too
NOTEBOOK="${LAB_NOTEBOOK:-notebooks/01_inspect_checkpoint.ipynb}"
[ -f "$NOTEBOOK" ] || { echo "LAB_NOTEBOOK=$NOTEBOOK does not exist" >&2; exit 1; }

if [ -z "${LAB_NO_DEMO:-}" ]; then
  "$PY" -c "
from workbench.demo import demo_checkpoint
d = demo_checkpoint()
print(f'embedded checkpoint ready: {d.packed} (BF16 reference {d.reference})')"
fi

extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)   # containers often run as root; Jupyter refuses otherwise
"$PY" -m jupyterlab --ServerApp.root_dir="$ROOT" --ServerApp.port="${LAB_PORT:-8888}" \
  --LabApp.default_url="/lab/tree/$NOTEBOOK" "${extra[@]}" "$@" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null' INT TERM EXIT

# Jupyter writes its URL and token into a runtime file; print the link to the notebook itself.
for _ in $(seq 1 120); do
  kill -0 "$server" 2>/dev/null || { wait "$server"; exit $?; }
  url="$("$PY" - "$server" "$NOTEBOOK" <<'EOF'
import json, subprocess, sys
pid, nb = int(sys.argv[1]), sys.argv[2]
out = subprocess.run([sys.executable, "-m", "jupyter", "server", "list", "--json"],
                     capture_output=True, text=True).stdout
for line in out.splitlines():
    s = json.loads(line)
    if s.get("pid") == pid:
        token = f"?token={s['token']}" if s.get("token") else ""
        print(f"{s['url'].rstrip('/')}/lab/tree/{nb}{token}")
EOF
)"
  if [ -n "$url" ]; then
    echo
    echo "JupyterLab is running. Open: $url"
    echo "(Ctrl-C stops it.)"
    break
  fi
  sleep 0.5
done
[ -n "${url:-}" ] || echo "JupyterLab started but did not report its URL; see its log above" >&2
wait "$server"
