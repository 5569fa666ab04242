#!/usr/bin/env bash
# A one-node Slurm cluster on loopback, for trying the Slurm runbook (and train.sbatch) on one
# machine: munged, slurmctld and slurmd from Debian's packages (apt-get install slurm-wlm munge),
# run as root, the node registered as localhost at 127.0.0.1, state and logs under DIR.
#
#   bash docs/runbooks/slurm/local-slurm.sh start [DIR]   # prints the SLURM_CONF to export
#   bash docs/runbooks/slurm/local-slurm.sh stop [DIR]
# Ports: SLURMCTLD_PORT (default 16817) and SLURMD_PORT (default 16818). LOCAL_SLURM_WAIT: seconds
# to wait for the node to become idle (default 60); on failure the logs' tails are printed.
#
# Made for a bare machine or container (no systemd, no cgroup delegation): munged is started
# here when it is not running, with a key created if the package left none; the node's layout
# is the one slurmd detects (`slurmd -C`), so the node is never drained for having fewer CPUs or
# less memory than configured; no plugin needs cgroups (process tracking by /proc, no task binding).
set -euo pipefail
cmd=${1:?start or stop}
dir=$(realpath -m "${2:-/tmp/kinetics-fast-slurm}")
conf=$dir/slurm.conf
wait_s=${LOCAL_SLURM_WAIT:-60}

stop_pids() {  # TERM the processes in these pid files, wait (up to 10 s) until all are gone
  local pids=() f pid
  for f in "$@"; do
    pid=$(cat "$f" 2>/dev/null) && kill "$pid" 2>/dev/null && pids+=("$pid")
  done
  for _ in $(seq 100); do
    alive "${pids[@]}" || return 0
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null || true
}

alive() {  # whether any of these processes still runs
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

stop_slurm() {  # the Slurm daemons of this DIR, and munged if this script started it for this DIR
  local munged=()
  [ "${1:-}" = munge ] && [ -f "$dir/munged.started" ] && munged=(/run/munge/munged.pid)
  stop_pids "$dir/slurmd.pid" "$dir/slurmctld.pid" "${munged[@]}"
  rm -f "$dir/slurmd.pid" "$dir/slurmctld.pid"
  [ ${#munged[@]} = 0 ] || rm -f "$dir/munged.started"
}

logs() {  # the tails of the daemons' logs, for an error message
  for log in "$dir/slurmctld.log" "$dir/slurmd.log" /var/log/munge/munged.log; do
    [ -f "$log" ] && { echo "--- last lines of $log:"; tail -n 15 "$log"; }
  done
  return 0
}

fail() {
  { echo "local Slurm did not come up: $1"; logs; } >&2
  exit 1
}

case "$cmd" in
  stop) stop_slurm munge; exit 0 ;;
  start) ;;
  *) echo "usage: $0 start|stop [DIR]" >&2; exit 2 ;;
esac

for tool in munge munged slurmctld slurmd sbatch sinfo scontrol; do
  command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install slurm-wlm munge" >&2; exit 1; }
done
mkdir -p "$dir/state" "$dir/spool"
stop_slurm  # a previous start's daemons, before anything new is started

if ! munge -n >/dev/null 2>&1; then  # munged authenticates every Slurm message
  install -d -o munge -g munge -m 0755 /run/munge /var/lib/munge /var/log/munge
  install -d -o munge -g munge -m 0700 /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then  # the package's postinst may not have made one
    if command -v mungekey >/dev/null; then
      runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
  fi
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  runuser -u munge -- munged || fail "munged would not start"
  touch "$dir/munged.started"
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.2; done
  munge -n >/dev/null 2>&1 || fail "munged started but does not answer on /run/munge"
fi

# the node as slurmd detects it (CPUs, boards, sockets, cores, threads), half its memory
detected=$(slurmd -C | head -n 1 | tr ' ' '\n')
layout=$(grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' <<<"$detected" | paste -sd' ' -)
detected_mb=$(sed -n 's/^RealMemory=//p' <<<"$detected")
[ -n "$layout" ] && [ -n "$detected_mb" ] || fail "slurmd -C did not describe this node: $(slurmd -C 2>&1)"
cat > "$conf" <<CONF
ClusterName=kinetics-fast-local
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 $layout RealMemory=$(( detected_mb / 2 )) State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
rm -f "$dir/slurmctld.log" "$dir/slurmd.log"
slurmctld -f "$conf" || fail "slurmctld exited at start"
slurmd -f "$conf" -N localhost || fail "slurmd exited at start"
export SLURM_CONF=$conf
resumed=0
for _ in $(seq $(( wait_s * 5 ))); do
  state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
  case "$state" in
    idle) echo "export SLURM_CONF=$conf"; exit 0 ;;
    # responding (no '*') but down or drained, e.g. by an old state file: return it to service once
    down|drained|draining|drain) [ $resumed = 1 ] || scontrol update nodename=localhost state=resume || true; resumed=1 ;;
  esac
  for daemon in slurmctld slurmd; do
    pid=$(cat "$dir/$daemon.pid" 2>/dev/null) || continue  # not written yet
    kill -0 "$pid" 2>/dev/null || fail "$daemon died"
  done
  sleep 0.2
done
fail "after ${wait_s} s the node is '${state:-not listed}' ($(sinfo -h -R 2>/dev/null | tr -s ' ' || true)), not idle"
