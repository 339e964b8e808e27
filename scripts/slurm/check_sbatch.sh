#!/bin/bash
# Check scripts/slurm/train_ep.sbatch against a real Slurm controller without a cluster:
#
#   sudo scripts/slurm/check_sbatch.sh
#
# Needs Slurm's controller and clients and MUNGE (Debian: apt-get install -y slurm-wlm). Starts
# a throwaway munged and slurmctld (everything in a temporary directory, their own socket and
# ports; nothing under /etc is read or written) describing two 8-GPU "cloud" nodes that never
# boot, then asks `sbatch --test-only` whether the script's #SBATCH request could be scheduled:
#
# - as written (2 nodes x 8 GPUs, 32 CPUs per task, 30 min): must be accepted;
# - with the README's override `--nodes=4 ... --preset small --steps 500` on this 2-node
#   cluster, and with 9 GPUs per node: must be refused (the check can fail).
#
# What this does not check: the job's body (scontrol show hostnames, srun, torchrun's
# rendezvous between nodes, NCCL), which needs nodes that run; scripts/two_node_torchrun.sh
# exercises that rendezvous on one machine. Exit status 0 when every answer is as expected.

set -euo pipefail

for tool in munged slurmctld sbatch; do
    command -v "$tool" > /dev/null || { echo "check_sbatch: $tool not found (apt-get install -y slurm-wlm)" >&2; exit 2; }
done
if [ "$(id -u)" != 0 ]; then
    echo "check_sbatch: run as root (the throwaway slurmctld runs as SlurmUser=root)" >&2
    exit 2
fi

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="$(mktemp -d "${TMPDIR:-/tmp}/moe_lab_slurm.XXXXXX")"
chmod 700 "$DIR"
mkdir -p "$DIR/state" "$DIR/spool"
pids=()
teardown() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2> /dev/null || true
    done
    wait 2> /dev/null || true
    rm -rf "$DIR"
}
trap teardown EXIT

dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
chmod 400 "$DIR/munge.key"
munged --foreground --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed" \
    > "$DIR/munged.out" 2>&1 &
pids+=($!)

PORT=$((20000 + RANDOM % 20000))
cat > "$DIR/slurm.conf" << CONF
ClusterName=moelabcheck
SlurmctldHost=$(hostname)
SlurmUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=600
ResumeTimeout=600
NodeName=gpunode[1-2] CPUs=64 Sockets=2 CoresPerSocket=32 ThreadsPerCore=1 RealMemory=100000 Gres=gpu:8 State=CLOUD
PartitionName=gpu Nodes=gpunode[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$DIR/slurm.conf"
for _ in $(seq 50); do [ -S "$DIR/munge.socket" ] && break; sleep 0.1; done
slurmctld -D -i > "$DIR/slurmctld.out" 2>&1 &
pids+=($!)
for _ in $(seq 100); do scontrol ping > /dev/null 2>&1 && break; sleep 0.1; done
scontrol ping > /dev/null || { echo "check_sbatch: slurmctld did not start:" >&2; tail -n 5 "$DIR/slurmctld.out" >&2; exit 2; }

SCRIPT="$ROOT/scripts/slurm/train_ep.sbatch"
failed=0
expect() {  # expect accepted|refused ARGS...
    local want=$1 got out
    shift
    if out=$(cd "$ROOT" && sbatch --test-only "$@" 2>&1); then got=accepted; else got=refused; fi
    echo "sbatch --test-only $* -> $got: $out"
    [ "$got" = "$want" ] || { echo "  expected: $want" >&2; failed=1; }
}
expect accepted "$SCRIPT"
expect refused --nodes=4 "$SCRIPT" --preset small --steps 500
expect refused --gpus-per-node=9 "$SCRIPT"
exit $failed
