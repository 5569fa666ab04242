#!/usr/bin/env bash
# A one-node Slurm cluster on loopback, for trying the Slurm runbook (and train.sbatch) on one
# machine: munged, slurmctld and slurmd from Debian's packages (apt-get install slurm-wlm munge),
# run as root, the node registered as localhost at 127.0.0.1, state and logs under DIR.
#
#   bash docs/runbooks/slurm/local-slurm.sh start [DIR]   # prints the SLURM_CONF to export
#   bash docs/runbooks/slurm/local-slurm.sh stop [DIR]
# Ports: SLURMCTLD_PORT (default 16817) and SLURMD_PORT (default 16818).
set -euo pipefail
cmd=${1:?start or stop}
dir=$(realpath -m "${2:-/tmp/kinetics-fast-slurm}")
conf=$dir/slurm.conf

stop() {  # the daemons this script started, munged only if it started it
  for pid in "$dir"/slurmd.pid "$dir"/slurmctld.pid; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  [ -f "$dir/munged.started" ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null && rm -f "$dir/munged.started"
  return 0
}

case "$cmd" in
  stop) stop; exit 0 ;;
  start) ;;
  *) echo "usage: $0 start|stop [DIR]" >&2; exit 2 ;;
esac

for tool in munged slurmctld slurmd sbatch; do
  command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install slurm-wlm munge" >&2; exit 1; }
done
mkdir -p "$dir/state" "$dir/spool"
if ! munge -n >/dev/null 2>&1; then  # munged authenticates every Slurm message
  install -d -o munge -g munge /run/munge /var/lib/munge /var/log/munge
  runuser -u munge -- munged
  touch "$dir/munged.started"
fi
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
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
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
stop
slurmctld -f "$conf"
slurmd -f "$conf" -N localhost
export SLURM_CONF=$conf
for _ in $(seq 50); do
  sinfo -h -o %T 2>/dev/null | grep -qx idle && { echo "export SLURM_CONF=$conf"; exit 0; }
  sleep 0.2
done
echo "local Slurm did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
exit 1
