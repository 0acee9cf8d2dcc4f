#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying (and CI-testing) the sbatch
# scripts against a real slurmctld/slurmd. Needs root and Debian/Ubuntu.
#
#   slurm/testbed.sh up      install (if needed) and start munged, slurmctld, slurmd
#   slurm/testbed.sh down    stop the daemons it started
#   slurm/testbed.sh env     print the SLURM_CONF line to eval in another shell
#
# State, logs and slurm.conf live under $MPITP_SLURM_DIR (default /tmp/mpitp-slurm).
# Lessons baked in: PMIx must be installed before slurmd starts (otherwise srun --mpi=pmix
# hangs), and the pmix plugin looks for pmix2/lib/libpmix.so, which Debian does not ship.
set -euo pipefail
D=${MPITP_SLURM_DIR:-/tmp/mpitp-slurm}
HOST=$(hostname -s)

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null && [ -e /usr/lib/x86_64-linux-gnu/libpmix.so.2 ]; then
    return
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q libpmix2 >/dev/null               # first: slurmd loads it at start
  apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
}

pmix_link() {
  local lib=/usr/lib/x86_64-linux-gnu/pmix2/lib
  if [ -e "$lib/libpmix.so.2" ] && [ ! -e "$lib/libpmix.so" ]; then
    ln -s libpmix.so.2 "$lib/libpmix.so"
  fi
}

write_conf() {
  mkdir -p "$D/state" "$D/spool" "$D/log"
  # CPUs, sockets, cores and memory exactly as slurmd sees them
  local hw
  hw=$(slurmd -C | head -1 | sed -e "s/^NodeName=[^ ]*//" -e 's/ UpTime=.*//')
  cat > "$D/slurm.conf" <<EOF
ClusterName=mpitp
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=$HOST NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=60 State=UP
EOF
}

up() {
  if [ -f "$D/slurm.conf" ] && SLURM_CONF=$D/slurm.conf sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    echo "slurm testbed already up: SLURM_CONF=$D/slurm.conf"
    return 0
  fi
  install
  pmix_link
  write_conf
  export SLURM_CONF=$D/slurm.conf
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || { mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  for _ in $(seq 1 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "slurm testbed up: SLURM_CONF=$SLURM_CONF ($(sinfo -h -o '%D node(s), %c CPUs, state %T'))"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm testbed did not come up; logs in $D/log" >&2
  tail -n 20 "$D/log/slurmctld.log" "$D/log/slurmd.log" >&2 || true
  return 1
}

down() {
  for f in slurmd slurmctld; do
    if [ -s "$D/$f.pid" ]; then kill "$(cat "$D/$f.pid")" 2>/dev/null || true; fi
  done
  sleep 1
  pkill -x slurmstepd 2>/dev/null || true
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$D/slurm.conf" ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
