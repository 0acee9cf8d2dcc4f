#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying (and CI-testing) the sbatch
# scripts against a real slurmctld/slurmd. Needs root and Debian/Ubuntu.
#
#   slurm/testbed.sh up      install (if needed) and start munged, slurmctld, slurmd
#   slurm/testbed.sh down    stop the daemons it started
#   slurm/testbed.sh env     print the SLURM_CONF line to eval in another shell
#
#   slurm/testbed.sh up-nodes N     a second cluster of N nodes: the minicluster's network
#   slurm/testbed.sh down-nodes     namespaces (bin/mpitp-minicluster), one slurmd in each
#   slurm/testbed.sh env-nodes      (NodeName = its hostname), its own slurmctld outside
#                                   them on the bridge; state under $MPITP_SLURM_DIR-nodes
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

# ---- several nodes: one slurmd per minicluster node -------------------------------
DN=${MPITP_SLURM_DIR:-/tmp/mpitp-slurm}-nodes
MINI="$(cd "$(dirname "$0")/.." && pwd)/bin/mpitp-minicluster"
MSTATE=${MPITP_MINICLUSTER_DIR:-/tmp/mpitp-minicluster}/state.json

mini_field() {  # a field of the minicluster's state: address, or addresses.mtp-n1
  python3 -c "import json, sys; v = json.load(open(sys.argv[1]))
for k in sys.argv[2].split('.'): v = v[k]
print(v)" "$MSTATE" "$1"
}

write_nodes_conf() {
  local n=$1 hw
  mkdir -p "$DN/state" "$DN/spool" "$DN/log"
  hw=$(slurmd -C | head -1 | sed -e "s/^NodeName=[^ ]*//" -e 's/ UpTime=.*//' -e 's/RealMemory=[0-9]*/RealMemory=1000/')
  {
    echo "ClusterName=mpitpnodes"
    echo "SlurmctldHost=$HOST($(mini_field address))"
    echo "SlurmctldPort=6917"
    echo "SlurmdPort=6918"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$DN/state"
    echo "SlurmdSpoolDir=$DN/spool/%n"
    echo "SlurmctldPidFile=$DN/slurmctld.pid"
    echo "SlurmdPidFile=$DN/slurmd.%n.pid"
    echo "SlurmctldLogFile=$DN/log/slurmctld.log"
    echo "SlurmdLogFile=$DN/log/slurmd.%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "SchedulerType=sched/backfill"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=10"   # losing a node is what these nodes are for: DOWN ~25 s after it dies (30: ~37 s; 5 gains nothing)
    echo "InactiveLimit=0"
    echo "KillWait=5"
    for i in $(seq 1 "$n"); do
      echo "NodeName=mtp-n$i NodeAddr=$(mini_field "addresses.mtp-n$i") $hw State=UNKNOWN"
    done
    echo "PartitionName=nodes Nodes=ALL Default=YES MaxTime=60 State=UP"
  } > "$DN/slurm.conf"
  echo "PMIxCliTmpDirBase=$DN/pmix-base" > "$DN/mpi.conf"   # bound to a per-node directory
}

nodes_ready() {  # how many nodes answer (idle, mixed or allocated)
  sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)$' || true
}

up_nodes() {
  local n=${1:-2}
  export SLURM_CONF=$DN/slurm.conf
  if [ -f "$SLURM_CONF" ] && [ "$(nodes_ready)" = "$n" ]; then
    echo "slurm nodes testbed already up: SLURM_CONF=$SLURM_CONF"
    return 0
  fi
  down_nodes
  install
  pmix_link
  python3 "$MINI" up --nodes "$n" >/dev/null
  write_nodes_conf "$n"
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || { mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  slurmctld -f "$SLURM_CONF"
  for i in $(seq 1 "$n"); do
    mkdir -p "$DN/spool/mtp-n$i"
    # nsenter, not ip netns exec: that one remounts /sys, hiding the cgroup tree slurmd needs;
    # a mount namespace of its own gives each node a private PMIx directory (all share /tmp)
    mkdir -p "$DN/pmix/mtp-n$i" "$DN/pmix-base"
    nsenter --net=/run/netns/mtp-n$i unshare --uts --mount -- sh -c \
      "mount --bind '$DN/pmix/mtp-n$i' '$DN/pmix-base' && hostname mtp-n$i && exec slurmd -f '$SLURM_CONF' -N mtp-n$i"
  done
  for _ in $(seq 1 60); do
    if [ "$(nodes_ready)" = "$n" ]; then
      echo "slurm nodes testbed up: SLURM_CONF=$SLURM_CONF ($(sinfo -h -o '%D node(s) %N, state %T'))"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm nodes testbed did not come up; logs in $DN/log" >&2
  tail -n 20 "$DN"/log/*.log >&2 || true
  return 1
}

down_nodes() {
  for f in "$DN"/slurmd.*.pid "$DN/slurmctld.pid"; do
    if [ -s "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; fi
  done
  # what jobs left in the nodes (a step whose node was lost, its batch script, ranks)
  for ns in $(ip netns list 2>/dev/null | awk '/^mtp-n[0-9]/ {print $1}'); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  sleep 1
  rm -rf "$DN/state" "$DN/spool" "$DN/pmix" "$DN"/*.pid
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$D/slurm.conf" ;;
  up-nodes) up_nodes "${2:-2}" ;;
  down-nodes) down_nodes ;;
  env-nodes) echo "export SLURM_CONF=$DN/slurm.conf" ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
