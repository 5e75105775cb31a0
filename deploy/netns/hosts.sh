#!/usr/bin/env bash
# Separate hosts on one machine: network namespaces joined by veth pairs to a bridge. The bridge
# lives in a namespace of its own (the hub), which is also where clients run: every host's
# address is reachable from it, and nothing of the machine's own network is touched. Needs root
# (ip netns, from iproute2).
#
#   deploy/netns/hosts.sh hub HUB                  make the hub (bridge br0, 10.77.0.1/16) if missing
#   deploy/netns/hosts.sh add HUB HOST IP          make namespace HOST with eth0 = IP/16 on HUB's bridge
#   deploy/netns/hosts.sh del HOST...              delete hosts (their veth pairs go with them)
#   deploy/netns/hosts.sh gc HUB                   delete HUB if no host is attached to it any more
#   deploy/netns/hosts.sh check                    exit 0 when namespaces can be made here
#   deploy/netns/hosts.sh impair HOST LOSS% DELAY_MS  a lossy, slow link (see below); prints
#                                                  what it applied, on one line
#   deploy/netns/hosts.sh heal HOST                undo impair
#
# Run a program on a host:  ip netns exec HOST PROGRAM...
# Faults on a host's link:  ip -n HOST link set eth0 down|up
#                           hosts.sh impair HOST 1 20: tc netem (loss and delay, both on the
#                           host's egress); on a kernel without netem, the loss by an nftables
#                           rule (random drops, both directions) and, for the delay, a slow link
#                           instead (tbf at 20 Mbit/s: queueing delay under load, not a fixed one)
# Addresses are 10.77.0.0/16 inside these namespaces only.
set -euo pipefail

die() { echo "hosts.sh: $*" >&2; exit 1; }

exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

# A veth name in the hub for HOST: at most 15 characters, unique per host name.
peer_name() { printf 'v%s' "$(printf '%s' "$1" | cksum | awk '{printf "%x", $1}')"; }

cmd="${1:-}"
[ -n "$cmd" ] && shift
case "$cmd" in
  check)
    [ "$(id -u)" = 0 ] || die "needs root (ip netns add)"
    probe="strata-probe-$$"
    ip netns add "$probe" 2>/dev/null || die "cannot make a network namespace here"
    ok=0
    ip -n "$probe" link add name pa type veth peer name pb 2>/dev/null && ok=1
    ip netns del "$probe"
    [ "$ok" = 1 ] || die "cannot make veth pairs here"
    command -v tc >/dev/null || die "tc (iproute2) is missing"
    ;;
  hub)
    hub="${1:?usage: hosts.sh hub HUB}"
    exists "$hub" && exit 0
    ip netns add "$hub"
    ip -n "$hub" link set lo up
    ip -n "$hub" link add br0 type bridge
    ip -n "$hub" addr add 10.77.0.1/16 dev br0
    ip -n "$hub" link set br0 up
    ;;
  add)
    [ $# -eq 3 ] || die "usage: hosts.sh add HUB HOST IP"
    hub="$1" host="$2" addr="$3"
    exists "$hub" || die "no hub $hub (hosts.sh hub $hub)"
    exists "$host" && ip netns del "$host"
    peer="$(peer_name "$host")"
    ip -n "$hub" link del "$peer" 2>/dev/null || true
    ip netns add "$host"
    ip -n "$host" link set lo up
    ip -n "$hub" link add "$peer" type veth peer name eth0 netns "$host"
    ip -n "$hub" link set "$peer" master br0 up
    ip -n "$host" addr add "$addr/16" dev eth0
    ip -n "$host" link set eth0 up
    ip -n "$host" route add default dev eth0 2>/dev/null || true
    ;;
  del)
    for host in "$@"; do
      exists "$host" && ip netns del "$host"
    done
    ;;
  gc)
    hub="${1:?usage: hosts.sh gc HUB}"
    exists "$hub" || exit 0
    for _ in $(seq 20); do  # a deleted host's veth leaves the bridge shortly after
      if [ -z "$(ip -n "$hub" link show master br0 2>/dev/null)" ]; then
        ip netns del "$hub"
        exit 0
      fi
      sleep 0.1
    done
    ;;
  impair)
    [ $# -eq 3 ] || die "usage: hosts.sh impair HOST LOSS_PERCENT DELAY_MS"
    host="$1" loss="$2" delay="$3"
    if tc -n "$host" qdisc replace dev eth0 root netem loss "$loss%" delay "${delay}ms" 2>/dev/null; then
      echo "netem loss $loss% delay ${delay}ms"
      exit 0
    fi
    command -v nft >/dev/null || die "no netem in this kernel and no nft (apt-get install nftables)"
    threshold="$(awk -v p="$loss" 'BEGIN { printf "%d", p * 100 }')"  # of 10000
    printf '%s\n' "table inet strata_impair {" \
      "  chain in { type filter hook input priority 0; iifname \"eth0\" numgen random mod 10000 < $threshold drop; }" \
      "  chain out { type filter hook output priority 0; oifname \"eth0\" numgen random mod 10000 < $threshold drop; }" \
      "}" | ip netns exec "$host" nft -f -
    tc -n "$host" qdisc replace dev eth0 root tbf rate 20mbit burst 32kb latency 200ms
    echo "no netem in this kernel: nftables random drops of $loss% each way; tbf 20mbit (burst 32kb) instead of a ${delay} ms delay"
    ;;
  heal)
    host="${1:?usage: hosts.sh heal HOST}"
    tc -n "$host" qdisc del dev eth0 root 2>/dev/null || true
    ip netns exec "$host" nft delete table inet strata_impair 2>/dev/null || true
    ;;
  *)
    sed -n '2,27p' "$0" >&2
    exit 2
    ;;
esac
