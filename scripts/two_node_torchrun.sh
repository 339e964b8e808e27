#!/bin/bash
# Two "nodes" on one machine: torchrun's multi-node rendezvous, exercised without a cluster.
#
#   sudo scripts/two_node_torchrun.sh                      # tiny preset, 4 steps, 1F1B
#   sudo PYTHON=.venv/bin/python STEPS=6 scripts/two_node_torchrun.sh
#
# Builds two network namespaces joined by a veth pair (node A at 10.214.0.1, node B at
# 10.214.0.2; nothing is added to the machine's own namespace), then runs in each one
#
#   torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint 10.214.0.1:PORT
#
# of scripts/train_ep.py (expert parallelism over 4 gloo ranks, the merged 1F1B schedule), so
# the rendezvous, the store and every all-to-all between the nodes cross the veth "cable".
# It also runs the same training as one 4-rank node (torchrun --standalone) and compares the
# losses of every step: they must be equal (the same ranks compute the same things; only
# where the processes live differs). Exit status 0 when they are, 1 when not, 2 on a failure.
# The namespaces are deleted on exit, whatever happens. Needs root and iproute2 (ip).
#
# Node A hosts the rendezvous store (``--rdzv-conf is_host=1``: torchrun would otherwise
# look for the endpoint's address among the machine's own, which live in another
# namespace), and each node names its own address (``--local-addr``) and interface
# (``GLOO_SOCKET_IFNAME``), since the machine's hostname resolves outside the namespaces.

set -euo pipefail

PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-4}
BATCH=${BATCH:-4}
MICROBATCHES=${MICROBATCHES:-2}
PORT=${PORT:-29400}
TIMEOUT_S=${TIMEOUT_S:-300}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TAG="m2n$$"
NS_A="moelab-$TAG-a"
NS_B="moelab-$TAG-b"
ADDR_A=10.214.0.1
ADDR_B=10.214.0.2
OUT="$(mktemp -d "${TMPDIR:-/tmp}/moe_lab_two_node.XXXXXX")"
TRAIN=("$ROOT/scripts/train_ep.py" --preset tiny --steps "$STEPS" --batch-size "$BATCH"
       --schedule 1f1b --microbatches "$MICROBATCHES" --json)

if [ "$(id -u)" != 0 ]; then
    echo "two_node_torchrun: network namespaces need root" >&2
    exit 2
fi
command -v ip > /dev/null || { echo "two_node_torchrun: ip not found (install iproute2)" >&2; exit 2; }

pids=()
teardown() {
    for pid in "${pids[@]}"; do
        kill -- "-$pid" 2> /dev/null || true
    done
    ip netns del "$NS_A" 2> /dev/null || true
    ip netns del "$NS_B" 2> /dev/null || true
    rm -rf "$OUT"
}
trap teardown EXIT

ip netns add "$NS_A"
ip netns add "$NS_B"
ip link add name "${TAG}a" netns "$NS_A" type veth peer name "${TAG}b" netns "$NS_B"
ip -n "$NS_A" addr add "$ADDR_A/24" dev "${TAG}a"
ip -n "$NS_B" addr add "$ADDR_B/24" dev "${TAG}b"
for ns in "$NS_A" "$NS_B"; do
    ip -n "$ns" link set lo up
done
ip -n "$NS_A" link set "${TAG}a" up
ip -n "$NS_B" link set "${TAG}b" up

node() {  # node NAMESPACE ADDRESS INTERFACE IS_HOST
    ip netns exec "$1" env GLOO_SOCKET_IFNAME="$3" OMP_NUM_THREADS=1 \
        timeout "$TIMEOUT_S" "$PYTHON" -m torch.distributed.run \
        --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint "$ADDR_A:$PORT" \
        --rdzv-id "$TAG" --rdzv-conf "is_host=$4" --local-addr "$2" --max-restarts 0 \
        "${TRAIN[@]}"
}

echo "two nodes: $NS_A ($ADDR_A, rendezvous host) and $NS_B ($ADDR_B), 2 ranks each"
setsid bash -c "$(declare -f node); $(declare -p TRAIN PYTHON TIMEOUT_S ADDR_A PORT TAG); \
    node $NS_A $ADDR_A ${TAG}a 1" > "$OUT/a.out" 2> "$OUT/a.err" &
pids+=($!)
setsid bash -c "$(declare -f node); $(declare -p TRAIN PYTHON TIMEOUT_S ADDR_A PORT TAG); \
    node $NS_B $ADDR_B ${TAG}b 0" > "$OUT/b.out" 2> "$OUT/b.err" &
pids+=($!)
status=0
wait "${pids[0]}" || status=$?
wait "${pids[1]}" || status=$?
pids=()
if [ "$status" != 0 ]; then
    echo "two-node run failed (exit $status); node A's and node B's last lines:" >&2
    tail -n 5 "$OUT/a.err" "$OUT/b.err" >&2
    exit 2
fi

echo "one node: torchrun --standalone --nproc_per_node 4"
if ! OMP_NUM_THREADS=1 timeout "$TIMEOUT_S" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc_per_node 4 "${TRAIN[@]}" > "$OUT/single.out" 2> "$OUT/single.err"; then
    echo "single-node run failed; its last lines:" >&2
    tail -n 5 "$OUT/single.err" >&2
    exit 2
fi

# Rank 0 prints the summary (one JSON line) on whichever node it was placed.
cat "$OUT/a.out" "$OUT/b.out" > "$OUT/two.out"
"$PYTHON" - "$OUT/two.out" "$OUT/single.out" << 'PY'
import json
import sys

def summary(path):
    lines = [line for line in open(path) if line.startswith("{")]
    if len(lines) != 1:
        sys.exit(f"expected one JSON summary in {path}, found {len(lines)}")
    return json.loads(lines[0])

two, one = summary(sys.argv[1]), summary(sys.argv[2])
print(f"two nodes  (world {two['world_size']}, {two['backend']}): losses {two['losses']}")
print(f"one node   (world {one['world_size']}, {one['backend']}): losses {one['losses']}")
same = two["losses"] == one["losses"] and two["world_size"] == one["world_size"] == 4
print("losses equal: yes" if same else "losses equal: NO")
sys.exit(0 if same else 1)
PY
