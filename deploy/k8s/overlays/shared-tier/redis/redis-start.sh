#!/bin/sh
# Starts one node of the shared tier's Redis Cluster (the StatefulSet strata-redis, ../redis.yaml):
#   1. the configuration: redis.conf, the password of the Secret strata-redis-auth (requirepass,
#      and masterauth for a replica), the name the node announces (REDIS_HOSTNAME); written to
#      /run/redis (memory), so the password is on no command line and no disk;
#   2. the peers' addresses in nodes.conf, from their names: after every pod restarted at once
#      (new pod IPs), the addresses saved there would lead nowhere and the nodes would never find
#      each other again;
#   3. redis-server, in this process (signals reach it).
set -eu

password=$(head -n 1 /etc/redis/auth/password)
case "$password" in
  '' | '#'* | *[!A-Za-z0-9._-]*)
    echo "redis-start: /etc/redis/auth/password (Secret strata-redis-auth) holds no password" \
      "(the placeholder?): give one line of [A-Za-z0-9._-], e.g. openssl rand -hex 32" >&2
    exit 1
    ;;
esac
umask 077
{
  cat /etc/redis/strata/redis.conf
  echo "requirepass $password"
  echo "masterauth $password"
  echo "cluster-announce-hostname $REDIS_HOSTNAME"
  # With REDIS_TLS_DIR (the overlay shared-tier-tls): TLS only, on the same ports, for clients,
  # the cluster bus and replication alike; clients must show a certificate the CA signed.
  if [ -n "${REDIS_TLS_DIR:-}" ]; then
    echo "port 0"
    echo "tls-port 6379"
    echo "tls-cert-file $REDIS_TLS_DIR/node.crt"
    echo "tls-key-file $REDIS_TLS_DIR/node.key"
    echo "tls-ca-cert-file $REDIS_TLS_DIR/ca.crt"
    echo "tls-auth-clients yes"
    echo "tls-cluster yes"
    echo "tls-replication yes"
  fi
} >/run/redis/redis.conf

# A node's line: <id> <ip>:<port>@<bus-port>,<hostname> <flags> ... (the last line is "vars ...").
# A name that does not resolve yet (its pod is starting too) is asked again, for up to 30 s; after
# that its old address stays (gossip brings the new one once any node reaches it).
nodes=/data/nodes.conf
if [ -s "$nodes" ]; then
  tries=0
  while :; do
    unresolved=0
    : >"$nodes.new"
    while read -r id addr rest; do
      case "$addr" in
        *@*,?*)
          host=${addr#*,}
          host=${host%%,*}
          old=${addr%%@*}
          old=${old%:*}
          new=$(getent hosts "$host" | awk '{ print $1; exit }')
          if [ -n "$new" ]; then
            addr="$new${addr#"$old"}"
          else
            unresolved=$((unresolved + 1))
          fi
          ;;
      esac
      echo "$id $addr $rest" >>"$nodes.new"
    done <"$nodes"
    tries=$((tries + 1))
    if [ "$unresolved" = 0 ] || [ "$tries" -ge 30 ]; then break; fi
    sleep 1
  done
  mv "$nodes.new" "$nodes"
fi

exec redis-server /run/redis/redis.conf
