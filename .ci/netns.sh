#!/usr/bin/env bash
# Two network namespaces joined by a veth pair: two "nodes" on this one machine, for
# tests/e2e/test_two_nodes*.py. Needs root and iproute2. Idempotent: `up` first removes what a
# previous run with the same tag left; `down` removes everything of the tag (and is quiet when
# nothing is there). Only these namespaces carry the traffic (10.77.0.0/24 exists nowhere else).
#
#   bash .ci/netns.sh up [TAG]     # slmoe-TAG-0 (10.77.0.1/24, veth slTAG0) <-> slmoe-TAG-1 (10.77.0.2/24, slTAG1)
#   bash .ci/netns.sh down [TAG]
#   bash .ci/netns.sh check        # exit 0 if namespaces can be made here, else 1 with the reason
#
# Run a command on node N: ip netns exec slmoe-TAG-N <command>. TAG (default "ci", at most 8
# characters: interface names have 15) keeps concurrent runs apart.
set -euo pipefail

action=${1:-up}
tag=${2:-ci}
[[ "$tag" =~ ^[a-z0-9]{1,8}$ ]] || { echo "netns: TAG must be 1-8 of [a-z0-9], got '$tag'" >&2; exit 2; }
ns=("slmoe-$tag-0" "slmoe-$tag-1")
veth=("sl${tag}0" "sl${tag}1")
addr=(10.77.0.1/24 10.77.0.2/24)

down() {
    for n in "${ns[@]}"; do
        if ip netns list 2>/dev/null | grep -qw "^$n"; then
            ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
            ip netns del "$n"
        fi
    done
    ip link del "${veth[0]}" 2>/dev/null || true  # only if left in the root namespace
}

check() {
    if [ "$(id -u)" != 0 ]; then echo "netns: not root (network namespaces need CAP_NET_ADMIN)"; return 1; fi
    if ! command -v ip >/dev/null 2>&1; then echo "netns: iproute2 ('ip') is not installed"; return 1; fi
    local probe="slmoe-probe-$$" err
    if ! err=$(ip netns add "$probe" 2>&1); then echo "netns: cannot create a namespace: $err"; return 1; fi
    ip netns del "$probe"
    if ! err=$(ip link add "slprobe$$" type veth peer name "slprobe$$b" 2>&1); then
        echo "netns: cannot create a veth pair: $err"; return 1
    fi
    ip link del "slprobe$$" 2>/dev/null || true
}

up() {
    down
    ip netns add "${ns[0]}"
    ip netns add "${ns[1]}"
    ip link add "${veth[0]}" type veth peer name "${veth[1]}"
    for i in 0 1; do
        ip link set "${veth[$i]}" netns "${ns[$i]}"
        ip -n "${ns[$i]}" addr add "${addr[$i]}" dev "${veth[$i]}"
        ip -n "${ns[$i]}" link set "${veth[$i]}" up
        ip -n "${ns[$i]}" link set lo up
    done
    echo "netns: ${ns[0]} (${addr[0]%/*} on ${veth[0]}) <-> ${ns[1]} (${addr[1]%/*} on ${veth[1]})"
}

case "$action" in
    up) up ;;
    down) down ;;
    check) check ;;
    *) echo "usage: $0 up|down|check [TAG]" >&2; exit 2 ;;
esac
