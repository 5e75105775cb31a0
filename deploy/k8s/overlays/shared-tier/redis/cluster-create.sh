#!/bin/sh
# Forms the shared tier's Redis Cluster, once (the Job strata-redis-cluster-create,
# ../redis-cluster-create.yaml): waits until every node of STRATA_SHARED_TIER answers, then
# `redis-cli --cluster create` with a replica for every master.
#
# Does nothing when any node is in a cluster already (it knows another node, or serves slots):
# run again, it changes nothing. A formed cluster that lost its shape (a node replaced with an
# empty volume) is for `redis-cli --cluster check` and `--cluster fix`, not for this script.
set -eu

REDISCLI_AUTH=$(head -n 1 /etc/redis/auth/password)
export REDISCLI_AUTH
# With REDIS_TLS_DIR (the overlay shared-tier-tls) the nodes speak TLS only, and want a client
# certificate. redis-cli checks the chain, not the name: the nodes are dialled by address here.
tls=
if [ -n "${REDIS_TLS_DIR:-}" ]; then
  tls="--tls --cacert $REDIS_TLS_DIR/ca.crt --cert $REDIS_TLS_DIR/node.crt --key $REDIS_TLS_DIR/node.key"
fi
addrs=
for node in $(echo "$STRATA_SHARED_TIER" | tr ',' ' '); do
  host=${node%:*}
  port=${node##*:}
  # CLUSTER MEET takes IP addresses: the node's current one, from its name.
  tries=0
  while :; do
    ip=$(getent hosts "$host" | awk '{ print $1; exit }')
    reply=
    # shellcheck disable=SC2086 # $tls: one word per argument
    if [ -n "$ip" ]; then reply=$(timeout 5 redis-cli $tls -h "$ip" -p "$port" ping 2>&1 || true); fi
    if [ "$reply" = PONG ]; then break; fi
    tries=$((tries + 1))
    if [ "$tries" -ge 150 ]; then
      echo "cluster-create: $node (${ip:-no address}) does not answer PING: ${reply:-nothing}" >&2
      exit 1
    fi
    sleep 2
  done
  # shellcheck disable=SC2086 # $tls: one word per argument
  info=$(redis-cli $tls -h "$ip" -p "$port" cluster info | tr -d '\r')
  known=$(echo "$info" | sed -n 's/^cluster_known_nodes://p')
  slots=$(echo "$info" | sed -n 's/^cluster_slots_assigned://p')
  case "$known:$slots" in
    *[!0-9:]* | :* | *:)
      echo "cluster-create: $node: CLUSTER INFO says no cluster: $info" >&2
      exit 1
      ;;
  esac
  if [ "$known" -gt 1 ] || [ "$slots" -gt 0 ]; then
    echo "cluster-create: $node is in a cluster already ($known nodes known, $slots slots" \
      "assigned, $(echo "$info" | grep '^cluster_state:')): nothing to do"
    exit 0
  fi
  addrs="$addrs $ip:$port"
done

# shellcheck disable=SC2086 # one word per node, and per TLS argument
redis-cli $tls --cluster create $addrs --cluster-replicas 1 --cluster-yes
