#!/usr/bin/env bash
# Emulated nodes for the netns benchmarks (sourced, root required): one network namespace per node, each joined
# to a bridge (in a namespace of its own) by a veth pair whose two ends tc caps at a rate each way, like one
# NIC per node. Addresses SUBNET.1..COUNT live inside the namespaces only; nothing leaves them.

# netns_up PREFIX COUNT SUBNET RATE: namespaces PREFIXn0..PREFIXn{COUNT-1} at SUBNET.1.., bridge in PREFIXsw.
netns_up() {
    local p=$1 count=$2 subnet=$3 rate=$4 k ns
    ip netns add "${p}sw"
    ip -n "${p}sw" link add br0 type bridge
    ip -n "${p}sw" link set br0 up
    for k in $(seq 0 $((count - 1))); do
        ns="${p}n$k"
        ip netns add "$ns"
        ip link add "v$k" netns "$ns" type veth peer name "b$k" netns "${p}sw"
        ip -n "$ns" addr add "$subnet.$((k + 1))/24" dev "v$k"
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "v$k" up
        ip -n "${p}sw" link set "b$k" master br0 up
        # Cap the node's egress and its ingress (the bridge side's egress) at the rate.
        tc -n "$ns" qdisc add dev "v$k" root tbf rate "$rate" burst 1mb latency 200ms
        tc -n "${p}sw" qdisc add dev "b$k" root tbf rate "$rate" burst 1mb latency 200ms
    done
}

# netns_down PREFIX COUNT: remove what netns_up made (missing pieces are fine).
netns_down() {
    local p=$1 count=$2 k
    for k in $(seq 0 $((count - 1))); do ip netns del "${p}n$k" 2>/dev/null || true; done
    ip netns del "${p}sw" 2>/dev/null || true
}

# rate_bits RATE: a tc rate such as 1gbit or 500mbit in bits per second.
rate_bits() {
    echo "$1" | sed 's/gbit$/*1000000000/; s/mbit$/*1000000/' | bc
}
