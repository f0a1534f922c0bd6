#!/usr/bin/env bash
# Start a REAL two-node Slurm cluster (slurmctld + 2 slurmd + slurmdbd + MariaDB + munge) on this
# one machine, for tests, CI and trying launches on a laptop before a real cluster.
#
#   sudo jobs/slurm/local-cluster.sh        # installs Debian packages if missing, starts, prints ready
#   sudo jobs/slurm/stop-local-cluster.sh   # stops every daemon this script started
#
# Idempotent: on a running, healthy cluster it only prints the ready line. Every start is fresh
# (controller state wiped, FirstJobId from the clock) so job ids never repeat across restarts,
# which matters because accounting (MariaDB) is kept and sacct looks jobs up by id.
#
# Why each unusual setting (docs/formats.md, "Environment limits", has the summary):
# - accounting through slurmdbd: submitit reads job state only through sacct; without it every
#   state is UNKNOWN and a cancelled job never counts as done.
# - proctrack/linuxproc, task/none, jobacct_gather/none, MpiDefault=none: no cgroups/systemd here.
# - SlurmdParameters=config_overrides: lets each node declare more CPUs than the machine has, so
#   1x8 / 2x4 jobs schedule on a 2-core box (OverSubscribe=FORCE does not; such jobs pend forever).
# - AuthInfo=cred_expire=10 and bf_interval=2: a requeued job restarts in seconds, not minutes.
#
# Environment knobs: WORKBENCH_SLURM_DIR (state folder, default /var/lib/workbench-slurm),
# WORKBENCH_SLURM_CPUS (CPUs each node declares, default 8), WORKBENCH_SLURM_TIMEOUT (seconds
# for each wait, default 60).
set -euo pipefail

STATE=${WORKBENCH_SLURM_DIR:-/var/lib/workbench-slurm}
NODE_CPUS=${WORKBENCH_SLURM_CPUS:-8}
WAIT_S=${WORKBENCH_SLURM_TIMEOUT:-60}
CLUSTER=workbench
NODES=(n1 n2)
NODE_PORTS=(17001 17002)
CTLD_PORT=17010
DBD_PORT=17011
MARKER="# managed by workbench jobs/slurm/local-cluster.sh"
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)

die() { echo "local-cluster: ERROR: $*" >&2; exit 1; }
log() { echo "local-cluster: $*" >&2; }

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts system daemons); try: sudo $0"
[[ -f /etc/debian_version ]] || die "needs Debian (or a derivative) with apt; /etc/debian_version not found"

# wait_for SECONDS DESCRIPTION CMD...: poll CMD until it succeeds, bounded.
wait_for() {
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= end)); then
      log "timed out after ${limit}s waiting for ${what}"
      for f in "$STATE"/log/*.log; do [[ -f $f ]] && { echo "--- tail $f" >&2; tail -n 15 "$f" >&2; }; done
      die "${what} did not come up within ${limit}s (logs above, all under $STATE/log)"
    fi
    sleep 0.5
  done
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Both nodes idle (or mixed, allocated or completing a job: a running cluster with jobs is healthy
# too, and restarting it would kill them) and sacct answers.
healthy() {
  local states
  states=$(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
  for n in "${NODES[@]}"; do
    grep -Eq "^$n (idle|mix|alloc|comp)\$" <<<"$states" || return 1
  done
  accounting_ready
}

# Accounting really answers: slurmctld has registered with slurmdbd (the cluster row carries its
# control host), and sacct, which opens a new connection to slurmdbd every call, succeeds three
# times in a row. One success right after a start is not enough: slurmdbd and slurmctld are
# still connecting, and the next sacct can fail with "failed to open persistent connection".
accounting_ready() {
  local host i
  host=$(timeout 10 sacctmgr -n -P show cluster "$CLUSTER" format=ControlHost 2>/dev/null) || return 1
  [[ -n ${host// /} ]] || return 1
  for i in 1 2 3; do
    timeout 10 sacct -n -X -S now-1minutes -o JobID >/dev/null 2>&1 || return 1
    ((i < 3)) && sleep 0.3
  done
  return 0
}

both_idle() {
  local states
  states=$(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
  for n in "${NODES[@]}"; do grep -q "^$n idle\$" <<<"$states" || return 1; done
}

ready_line() {
  echo "local-cluster: ready (cluster=$CLUSTER nodes=${NODES[*]} cpus_per_node=$NODE_CPUS" \
       "partition=debug state=$STATE conf=/etc/slurm/slurm.conf)"
}

# One start at a time (parallel test workers, CI steps), bounded.
mkdir -p "$STATE"
# Daemons are started with 9>&- so they do not inherit (and hold) the lock.
exec 9>"$STATE/.lock"
flock -w $((WAIT_S * 4)) 9 || die "another local-cluster.sh holds $STATE/.lock for more than $((WAIT_S * 4))s"

# --- already up? --------------------------------------------------------------------------------
if pid_alive "$STATE/run/slurmctld.pid" && pid_alive "$STATE/run/slurmdbd.pid" && healthy; then
  ready_line; exit 0
fi

# --- packages -----------------------------------------------------------------------------------
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]} (apt, --no-install-recommends)"
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d 101: the packages' postinst must not try to start services (no systemd here).
  policy_created=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
    policy_created=1
  fi
  {
    timeout 600 apt-get install -y -q --no-install-recommends "${missing[@]}" >"/tmp/workbench-slurm-apt.log" 2>&1 ||
      { timeout 120 apt-get update -q >>"/tmp/workbench-slurm-apt.log" 2>&1 &&
        timeout 600 apt-get install -y -q --no-install-recommends "${missing[@]}" >>"/tmp/workbench-slurm-apt.log" 2>&1; }
  } || { ((policy_created)) && rm -f /usr/sbin/policy-rc.d; tail -n 30 /tmp/workbench-slurm-apt.log >&2
         die "apt-get install ${missing[*]} failed (log: /tmp/workbench-slurm-apt.log)"; }
  ((policy_created)) && rm -f /usr/sbin/policy-rc.d
fi

# --- anything half-started from before: stop it, then start fresh ------------------------------
"$(dirname "$0")/stop-local-cluster.sh" --quiet || true

mkdir -p "$STATE"/{etc,run,log,ctld,spool,mysql}
for n in "${NODES[@]}"; do mkdir -p "$STATE/spool/$n"; done

# Node names must resolve: submitit uses the first node name as MASTER_ADDR.
for n in "${NODES[@]}"; do
  getent hosts "$n" >/dev/null || echo "127.0.0.1 $n $MARKER" >>/etc/hosts
done

# --- munge --------------------------------------------------------------------------------------
if ! (munge -n | unmunge) >/dev/null 2>&1; then
  [[ -s /etc/munge/munge.key ]] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null ||
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged 9>&-
  # munged writes its own pid file; remember that we started it so stop can end it.
  wait_for "$WAIT_S" "munged" bash -c 'munge -n | unmunge'
  cp /run/munge/munged.pid "$STATE/run/munged.pid" 2>/dev/null || pgrep -u munge -x munged >"$STATE/run/munged.pid"
fi

# --- MariaDB on a unix socket only --------------------------------------------------------------
# slurmdbd's MySQL client connects to StorageHost=localhost through libmariadb's default socket,
# so the server listens there; --skip-networking keeps it off TCP.
SOCK=/run/mysqld/mysqld.sock
mkdir -p /run/mysqld
if [[ ! -d $STATE/mysql/mysql ]]; then
  log "initialising MariaDB data in $STATE/mysql"
  timeout 120 mariadb-install-db --user=root --datadir="$STATE/mysql" --auth-root-authentication-method=socket \
    --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 || { tail -n 20 "$STATE/log/mariadb-install.log" >&2
      die "mariadb-install-db failed (log: $STATE/log/mariadb-install.log)"; }
fi
[[ -S $SOCK ]] && ! pid_alive "$STATE/run/mariadb.pid" && mariadb-admin --socket="$SOCK" ping >/dev/null 2>&1 &&
  die "another MariaDB/MySQL server already listens on $SOCK; stop it first (this script needs that socket)"
rm -f "$SOCK"
mariadbd --no-defaults --user=root --datadir="$STATE/mysql" --socket="$SOCK" --skip-networking \
  --pid-file="$STATE/run/mariadb.pid" --log-error="$STATE/log/mariadb.log" \
  --innodb-buffer-pool-size=64M --innodb-log-file-size=16M >/dev/null 2>&1 9>&- &
wait_for "$WAIT_S" "MariaDB" mariadb-admin --socket="$SOCK" ping

# --- Slurm configuration ------------------------------------------------------------------------
host=$(hostname -s)
# Job ids come from the clock (MaxJobId caps them at 67,043,328) so they never repeat across fresh
# starts that keep the accounting database.
first_job_id=$(( $(date +%s) % 60000000 + 1000 ))

cat >"$STATE/etc/slurm.conf" <<EOF
$MARKER
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobCompType=jobcomp/none
MailProg=/bin/true
SlurmdParameters=config_overrides
SchedulerParameters=bf_interval=2
ReturnToService=2
FirstJobId=$first_job_id
KillWait=10
# On a loaded 2-core box a cancelled training step can take over a minute to die; the default
# 60 s would drain the node ("Kill task failed") and fail every later job on it.
UnkillableStepTimeout=600
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[${NODE_PORTS[0]}-${NODE_PORTS[1]}] CPUs=$NODE_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF

cat >"$STATE/etc/slurmdbd.conf" <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
EOF
chmod 600 "$STATE/etc/slurmdbd.conf"

# Clients (sbatch, sacct from submitit in any shell) read /etc/slurm; link it to our state folder,
# but never overwrite a configuration someone else wrote.
mkdir -p /etc/slurm
for f in slurm.conf slurmdbd.conf; do
  if [[ -e /etc/slurm/$f && ! -L /etc/slurm/$f ]] && ! grep -qF "$MARKER" "/etc/slurm/$f"; then
    die "/etc/slurm/$f exists and was not written by this script; move it away first"
  fi
  ln -sfn "$STATE/etc/$f" "/etc/slurm/$f"
done

# --- daemons ------------------------------------------------------------------------------------
slurmdbd 9>&-
wait_for "$WAIT_S" "slurmdbd" sacctmgr -n list cluster
sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true

# -c: forget old jobs, -i: ignore state-file errors. A fresh controller every start.
rm -rf "${STATE:?}/ctld/"*
slurmctld -c -i 9>&-
wait_for "$WAIT_S" "slurmctld" scontrol ping
for n in "${NODES[@]}"; do slurmd -N "$n" 9>&-; done
wait_for "$WAIT_S" "both nodes idle" both_idle
wait_for "$WAIT_S" "accounting (slurmctld registered with slurmdbd, sacct answering)" accounting_ready

ready_line
