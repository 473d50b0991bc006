#!/usr/bin/env bash
# Real multi-node runs between emulated nodes (root required): one network namespace per node, each joined to
# a bridge by a veth pair (capped by tc at RATE each way, like one NIC per node), `rlsync train_embodied`
# started in every namespace with the same command line and its node rank, as a scheduler would.
#   1. control-plane cost per step: a no-op workload (4096 parameters, no compute, one env step per rollout
#      per step) with 4 rollouts, once over NODES nodes (one rollout per node, the trainer on node 0) and once
#      on one node, as `cargo bench --bench orchestrator` measures it on one host; mean `time/step`.
#   2. link down: the same run over NODES nodes, the last node's link set down after a few steps: node 0 must
#      fail naming that node within cluster.node_timeout_s + 2 s, and every process of the run must be gone
#      once the cut-off agent gave up (4 node timeouts).
#   3. weights over the chain: the synthetic workload at WEIGHTS_MIB of bf16 state (Adam-like updates at lr
#      1e-6), the trainer alone on node 0 and one rollout on each of ROLLOUT_NODES further nodes; bucket, then
#      patch; mean `time/sync_weights` past the first steps (the orchestrator's Sync until every rollout applied
#      and verified), against state size / link rate.
# Everything it creates (namespaces, bridge, run dirs) is removed on exit.
#
#   cargo build --release
#   sudo scripts/netns_multinode_bench.sh [NODES=4] [STEPS=300] [RATE=1gbit]
#   SECTIONS="3" WEIGHTS_MIB=512 ROLLOUT_NODES=4 WEIGHT_STEPS=6 sudo scripts/netns_multinode_bench.sh
#
# Addresses: 10.78.0.1..NODES inside the namespaces only; nothing leaves them.
set -euo pipefail
. "$(dirname "$0")/netns_lib.sh"
N=${1:-4}
STEPS=${2:-300}
RATE=${3:-1gbit}
TIMEOUT_S=${TIMEOUT_S:-2}
SECTIONS=${SECTIONS:-1 2 3}
WEIGHTS_MIB=${WEIGHTS_MIB:-512}
ROLLOUT_NODES=${ROLLOUT_NODES:-4}
WEIGHT_STEPS=${WEIGHT_STEPS:-6}
SYNCERS=${SYNCERS:-bucket_syncer patch_syncer}
WEIGHTS_EXTRA=${WEIGHTS_EXTRA:-}   # more overrides for section 3's runs, e.g. runner.verify_sync=false
# Namespaces: enough for sections 1-2 (N nodes) and section 3 (the trainer's node + ROLLOUT_NODES).
NS=$((N > ROLLOUT_NODES + 1 ? N : ROLLOUT_NODES + 1))
BIN=${BIN:-$(pwd)/target/release/rlsync}
P=rlmn$$
OUT=$(mktemp -d /tmp/rlmn.XXXXXX)
PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    netns_down "$P" "$NS"
    [ -n "${KEEP:-}" ] && echo "kept $OUT" || rm -rf "$OUT"
}
trap cleanup EXIT

[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, tc)" >&2; exit 2; }
[ -x "$BIN" ] || { echo "build it first: cargo build --release" >&2; exit 2; }
if { [[ " $SECTIONS " == *" 1 "* ]] || [[ " $SECTIONS " == *" 2 "* ]]; } && [ $((4 % N)) -ne 0 ]; then
    echo "NODES=$N must divide 4: sections 1 and 2 spread 4 rollouts evenly (cluster.slots_per_node=4/NODES)" >&2
    exit 2
fi

netns_up "$P" "$NS" 10.78.0 "$RATE"

export RLSYNC_RUN_TOKEN
RLSYNC_RUN_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')

# rlsync train_embodied with the no-op workload over NODES nodes: node K in namespace K.
node() { # node-rank nodes steps run-dir
    local k=$1 nodes=$2 steps=$3 dir=$4
    ip netns exec "${P}n$k" env TMPDIR="$OUT" "$BIN" train_embodied \
        model@actor.model=synthetic_small env@env.train=synthetic env@env.eval=synthetic \
        runner.val_check_interval=-1 runner.save_interval=-1 env.eval.total_num_envs=4 actor.model.params=4096 actor.model.tensors=4 actor.model.traj_bytes_per_step=64 \
        actor.model.rollout_ms_per_step=0 actor.model.train_ms=0 \
        env.train.total_num_envs=4 env.train.max_steps_per_rollout_epoch=1 rollout.chunk_steps=1 \
        runner.logger.logger_backends=[] runner.max_steps="$steps" runner.shutdown_grace_s=1 \
        cluster.num_nodes="$nodes" cluster.slots_per_node=$((4 / nodes)) cluster.component_placement.actor=0 \
        cluster.component_placement.rollout=0-3 cluster.node_rank="$k" cluster.master_addr=10.78.0.1 \
        cluster.master_port=29400 cluster.node_timeout_s="$TIMEOUT_S" hydra.run.dir="$dir"
}

mean_step_ms() { # run-dir
    python3 -c "
import json,sys
rows=[json.loads(l) for l in open('$1/metrics.jsonl')]
t=[r['time/step'] for r in rows[10:]]
print('%.3f' % (1000*sum(t)/len(t)))"
}

wants() { case " $SECTIONS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if wants 1; then
echo "== 1. control-plane cost per step, no-op workload, 4 rollouts, $STEPS steps"
node 0 1 "$STEPS" "$OUT/one" >"$OUT/one.out" 2>&1 || { cat "$OUT/one.out"; exit 1; }
echo "one node:      $(mean_step_ms "$OUT/one") ms per step (mean time/step past the first 10 steps)"
PIDS=()
for k in $(seq $((N - 1)) -1 1); do
    node "$k" "$N" "$STEPS" "$OUT/multi" >"$OUT/multi.$k" 2>&1 &
    PIDS+=($!)
done
node 0 "$N" "$STEPS" "$OUT/multi" >"$OUT/multi.0" 2>&1 || { cat "$OUT"/multi.*; exit 1; }
for pid in "${PIDS[@]}"; do wait "$pid" || { cat "$OUT"/multi.*; exit 1; }; done
PIDS=()
grep -q '"sync/verified":false' "$OUT/multi/metrics.jsonl" && { echo "an unverified sync" >&2; exit 1; }
echo "$N nodes (TCP): $(mean_step_ms "$OUT/multi") ms per step; every sync verified"
fi

if wants 2; then
echo "== 2. link down: node $((N - 1))'s veth set down after 20 steps (cluster.node_timeout_s=$TIMEOUT_S)"
for k in $(seq $((N - 1)) -1 1); do
    node "$k" "$N" 1000000 "$OUT/down" >"$OUT/down.$k" 2>&1 &
    PIDS+=($!)
done
node 0 "$N" 1000000 "$OUT/down" >"$OUT/down.0" 2>&1 &
head=$!
until [ -f "$OUT/down/metrics.jsonl" ] && [ "$(wc -l <"$OUT/down/metrics.jsonl")" -ge 20 ]; do sleep 0.05; done
ip -n "${P}n$((N - 1))" link set "v$((N - 1))" down
t0=$(date +%s.%N)
status=0
wait "$head" || status=$?
t1=$(date +%s.%N)
echo "node 0 exited with status $status $(echo "$t1 - $t0" | bc) s after the link went down:"
grep -m1 "^Error" "$OUT/down.0" || tail -3 "$OUT/down.0"
grep -q "node $((N - 1)) (" "$OUT/down.0" || { echo "the error does not name node $((N - 1))" >&2; exit 1; }
for pid in "${PIDS[@]}"; do wait "$pid" || true; done
t2=$(date +%s.%N)
[ -z "$(ls -A "$OUT" | grep '^rlsync-' || true)" ] || { echo "socket dirs left: $(ls "$OUT" | grep '^rlsync-')" >&2; exit 1; }
PIDS=()
echo "every agent exited $(echo "$t2 - $t0" | bc) s after the link went down"
left=$(pgrep -f -- "$OUT/" || true)
[ -z "$left" ] || { echo "processes left: $(ps -o pid,args -p "$(echo $left | tr ' ' ,)")" >&2; exit 1; }
for f in "$OUT"/down/.rlsync/launch.json "$OUT"/down/node-*/.rlsync/launch.json; do
    prefix=$(sed -n 's/.*"segment_prefix": *"\([^"]*\)".*/\1/p' "$f")
    if ls /dev/shm | grep -q "^$prefix"; then echo "segments left: $prefix*" >&2; exit 1; fi
done
echo "no process, socket dir or shared-memory segment of the run is left"
fi

# rlsync train_embodied with the synthetic WEIGHTS_MIB workload: node K in namespace K, the trainer alone on
# node 0, rollout K-1 on node K.
weights_node() { # node-rank syncer run-dir
    local k=$1 syncer=$2 dir=$3 nodes=$((ROLLOUT_NODES + 1))
    ip netns exec "${P}n$k" env TMPDIR="$OUT" timeout 900 "$BIN" train_embodied \
        model@actor.model=synthetic_small env@env.train=synthetic env@env.eval=synthetic \
        weight_syncer="$syncer" actor.model.params=$((WEIGHTS_MIB * 1048576 / 2)) actor.model.tensors=64 \
        actor.model.traj_bytes_per_step=64 runner.val_check_interval=-1 runner.save_interval=0 \
        env.train.total_num_envs="$ROLLOUT_NODES" env.eval.total_num_envs="$ROLLOUT_NODES" \
        env.train.max_steps_per_rollout_epoch=1 rollout.chunk_steps=1 \
        runner.logger.logger_backends=[] runner.max_steps="$WEIGHT_STEPS" runner.shutdown_grace_s=5 \
        cluster.num_nodes="$nodes" cluster.slots_per_node=1 cluster.component_placement.actor=0 \
        cluster.component_placement.rollout=1-"$ROLLOUT_NODES" cluster.node_rank="$k" \
        cluster.master_addr=10.78.0.1 cluster.master_port=29401 cluster.node_timeout_s=60 hydra.run.dir="$dir" $WEIGHTS_EXTRA
}

sync_ms() { # run-dir on|off: mean and range of time/sync_weights past the first two steps, bytes per sync, verified
    python3 -c "
import json
rows=[json.loads(l) for l in open('$1/metrics.jsonl')]
rows=[r for r in rows if 'sync/bytes' in r]
if '$2' == 'on':
    assert all(r['sync/verified'] for r in rows), 'an unverified sync'
checked='every sync verified on every rollout' if '$2' == 'on' else 'not verified (runner.verify_sync=false)'
t=[1000*r['time/sync_weights'] for r in rows[2:]]
b=sum(r['sync/bytes'] for r in rows[2:])/len(t)
print('%.0f %.0f %.0f %.0f %s' % (sum(t)/len(t), min(t), max(t), b, checked))"
}

if wants 3; then
    bits=$(rate_bits "$RATE")
    ideal=$(echo "scale=1; $WEIGHTS_MIB * 1048576 * 8 * 1000 / $bits" | bc)
    echo "== 3. weights over the chain: $WEIGHTS_MIB MiB bf16, trainer on node 0, one rollout on each of" \
        "$ROLLOUT_NODES nodes, $WEIGHT_STEPS steps; size / link rate = $ideal ms"
    declare -A mean
    verify=on
    case "$WEIGHTS_EXTRA" in *verify_sync=false*) verify=off ;; esac
    for syncer in $SYNCERS; do
        PIDS=()
        for k in $(seq "$ROLLOUT_NODES" -1 1); do
            weights_node "$k" "$syncer" "$OUT/w-$syncer" >"$OUT/w-$syncer.$k" 2>&1 &
            PIDS+=($!)
        done
        weights_node 0 "$syncer" "$OUT/w-$syncer" >"$OUT/w-$syncer.0" 2>&1 || { tail -n 20 "$OUT"/w-"$syncer".*; exit 1; }
        for pid in "${PIDS[@]}"; do wait "$pid" || { tail -n 20 "$OUT"/w-"$syncer".*; exit 1; }; done
        PIDS=()
        read -r m lo hi bytes checked <<<"$(sync_ms "$OUT/w-$syncer" "$verify")"
        mean[$syncer]=$m
        echo "$syncer: $m ms per sync (steps 3-$WEIGHT_STEPS: $lo-$hi ms, $(printf '%.2f' "$(echo "scale=3; $m / $ideal" | bc)") x size/rate)," \
            "$(printf '%.1f' "$(echo "scale=2; $bytes / 1048576" | bc)") MiB per sync, $checked"
    done
    [ -n "${mean[bucket_syncer]:-}" ] && [ -n "${mean[patch_syncer]:-}" ] && echo "patch is $(printf '%.1f' "$(echo "scale=2; ${mean[bucket_syncer]} / ${mean[patch_syncer]}" | bc)") x faster than bucket"
fi
