#!/usr/bin/env bash
# Stop the local Slurm cluster started by jobs/slurm/local-cluster.sh: only the daemons whose pid
# files it wrote under its state folder (never by process name). Keeps the accounting database and
# configuration, so the next start is a warm one.  --quiet: no output when nothing was running.
# --purge: also delete the state folder (MariaDB data included) and the /etc links.
set -uo pipefail

STATE=${WORKBENCH_SLURM_DIR:-/var/lib/workbench-slurm}
WAIT_S=${WORKBENCH_SLURM_TIMEOUT:-60}
QUIET=0; PURGE=0
for a in "$@"; do
  case $a in
    --quiet) QUIET=1 ;;
    --purge) PURGE=1 ;;
    *) echo "usage: $0 [--quiet] [--purge]" >&2; exit 2 ;;
  esac
done
[[ $(id -u) -eq 0 ]] || { echo "stop-local-cluster: ERROR: must run as root" >&2; exit 1; }

stopped=()
# stop NAME=PIDFILE...: TERM them all at once, wait (bounded), then KILL what is left.
stop() {
  local pids=() names=() item name pidfile pid end
  for item in "$@"; do
    name=${item%%=*}; pidfile=${item#*=}
    [[ -f $pidfile ]] || continue
    pid=$(cat "$pidfile" 2>/dev/null); rm -f "$pidfile"
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null && pids+=("$pid") && names+=("$name")
    fi
  done
  end=$((SECONDS + WAIT_S))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < end)); do sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  done
  stopped+=("${names[@]}")
}

# Compute nodes and controller first (their jobs end with them), then accounting, then the
# database and munge, so slurmdbd can still flush to MariaDB while it shuts down.
nodes=()
for f in "$STATE"/run/slurmd-*.pid; do
  [[ -e $f ]] || continue
  n=${f##*/slurmd-}; nodes+=("slurmd(${n%.pid})=$f")
done
stop "${nodes[@]}" "slurmctld=$STATE/run/slurmctld.pid"
stop "slurmdbd=$STATE/run/slurmdbd.pid"
stop "mariadb=$STATE/run/mariadb.pid" "munged=$STATE/run/munged.pid"

if ((PURGE)); then
  for f in slurm.conf slurmdbd.conf; do
    [[ -L /etc/slurm/$f && $(readlink "/etc/slurm/$f") == "$STATE/etc/$f" ]] && rm -f "/etc/slurm/$f"
  done
  sed -i '/# managed by workbench jobs\/slurm\/local-cluster.sh/d' /etc/hosts 2>/dev/null || true
  rm -rf "${STATE:?}"
fi

if ((!QUIET)) || ((${#stopped[@]})); then
  echo "stop-local-cluster: stopped ${stopped[*]:-nothing (no daemon was running)}${PURGE:+}$( ((PURGE)) && echo "; purged $STATE")"
fi
