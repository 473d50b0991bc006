#!/usr/bin/env bash
# Weight sync over the TCP chain between emulated nodes (root required): one network namespace per node, each
# joined to a bridge by a veth pair whose two ends are capped by tc (RATE each way, like one NIC per node),
# node 0 = the trainer, nodes 1..N = one rollout each. Runs bucket then patch sync and checks that every
# rollout reached the trainer's checksum at every version. Everything it creates is removed on exit.
#
#   cargo build --release --example chain_bench
#   sudo scripts/netns_chain_bench.sh [ROLLOUT_NODES=4] [MIB=512] [RATE=1gbit]     (STEPS=2 by default)
#
# Addresses: 10.77.0.1..N+1 inside the namespaces only (scripts/netns_lib.sh); nothing leaves them.
set -euo pipefail
. "$(dirname "$0")/netns_lib.sh"
N=${1:-4}
MIB=${2:-512}
RATE=${3:-1gbit}
STEPS=${STEPS:-2}
BIN=${BIN:-target/release/examples/chain_bench}
P=rlsb$$
OUT=$(mktemp -d)
PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    netns_down "$P" $((N + 1))
    rm -rf "$OUT"
}
trap cleanup EXIT

[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, tc)" >&2; exit 2; }
[ -x "$BIN" ] || { echo "build it first: cargo build --release --example chain_bench" >&2; exit 2; }

netns_up "$P" $((N + 1)) 10.77.0 "$RATE"

run() { # syncer
    local s=$1
    PIDS=()
    for k in $(seq "$N" -1 1); do
        next=-
        [ "$k" -lt "$N" ] && next="10.77.0.$((k + 2)):29510"
        ip netns exec "${P}n$k" timeout 600 "$BIN" node --rank "$k" --listen "10.77.0.$((k + 1)):29510" \
            --next "$next" --mib "$MIB" --syncer "$s" --steps "$STEPS" >"$OUT/$s.$k" 2>&1 &
        PIDS+=($!)
    done
    ip netns exec "${P}n0" timeout 600 "$BIN" node --rank 0 --next 10.77.0.2:29510 --mib "$MIB" \
        --syncer "$s" --steps "$STEPS" >"$OUT/$s.0" 2>&1 || { cat "$OUT/$s".*; exit 1; }
    for pid in "${PIDS[@]}"; do wait "$pid" || { cat "$OUT/$s".*; exit 1; }; done
    PIDS=()
    cat "$OUT/$s.0"
    # Every rollout must report the trainer's checksum for every version.
    for v in $(seq 1 "$STEPS"); do
        want=$(grep "\"version\":$v," "$OUT/$s.0" | sed 's/.*"checksum":"\([0-9a-f]*\)".*/\1/')
        for k in $(seq 1 "$N"); do
            got=$(grep "\"version\":$v," "$OUT/$s.$k" | sed 's/.*"checksum":"\([0-9a-f]*\)".*/\1/')
            [ "$got" = "$want" ] || { echo "node $k version $v: checksum $got, trainer $want" >&2; exit 1; }
        done
    done
    echo "$s: all $N rollout nodes verified at every version"
}

bits=$(rate_bits "$RATE")
echo "size/bandwidth: $(echo "scale=1; $MIB * 1048576 * 8 * 1000 / $bits" | bc) ms for $MIB MiB at $RATE"
run bucket
run patch
