#!/usr/bin/env bash
# Starts and stops a Strata cluster on this machine as separate processes on loopback: one
# strata-store (RAM + a disk tier), prefill and decode nodes, and strata-router in front, all
# reading one cluster file that this script writes.
#
#   deploy/local/cluster.sh up   [--dir DIR] [--codec SPEC] [--chunk N] [--prefill N] [--decode N]
#                                [--port-base P] [--http-port P] [--model DIR] [--calibration F]
#                                [--kv-budget BYTES] [--max-batch N] [--store-ram BYTES]
#                                [--store-disk BYTES (0: no disk tier)] [--router-flag F]...
#                                [--node-flag F]... (passed to every prefill and decode node)
#                                [--decode-flag F]... (to every decode node) [--decode-bin PATH]
#                                (another decode binary: the fault tests' strata-decode-faulty)
#                                [--prefill-local-ram BYTES] [--decode-local-ram BYTES] (each
#                                node's own RAM tier in front of the store; 0: none)
#                                [--etcd HOST:PORT [--etcd-ttl S]] (membership in a running etcd:
#                                nodes and stores register there, the router follows it)
#                                [--netns HUB] (every process on a host of its own: a network
#                                namespace HUB-PORTBASE-NAME with address 10.77.B.N on HUB's
#                                bridge, made by deploy/netns/hosts.sh; clients run in HUB:
#                                `ip netns exec HUB curl ...`. Needs root.)
#                                [--shared-tier N [--shared-tier-memory BYTES]] (a Redis Cluster
#                                of N masters and N replicas on loopback, ports PORT-BASE+200..,
#                                each master holding at most BYTES (256mb; volatile-lru), as the
#                                store's shared tier: strata-store --shared_tier, the
#                                router's, which counts its chunks as it routes, and the
#                                nodes', which read it while their store cannot answer. With
#                                --netns the Redis Cluster is a host of its own, "redis")
#                                [--host-stores] (a store per host, as on separate machines:
#                                host I runs prefill-I and decode-I, host 0 the cluster's store,
#                                host I > 0 a store of its own, store-I (ports PORT-BASE+100+I,
#                                metrics +150+I), which its nodes use (cluster file: nodes[].store).
#                                With --shared-tier, what one host's store holds is found on every
#                                other through it. With --netns, host I is one namespace holding
#                                prefill-I, decode-I and store-I; DIR/hosts says where each
#                                process runs)
#                                [--tls DIR] (mutual TLS between every process and the cluster
#                                token, HTTPS at the router, with the files of
#                                scripts/make_certs.sh in DIR, made there when DIR has no ca.crt;
#                                without --tls every process runs with --insecure. With
#                                --shared-tier, Redis serves TLS only (tls-port, its bus and
#                                replication too, client certificates required) and a password,
#                                DIR/redis.password (made when missing): --shared_tier_tls*,
#                                --shared_tier_password_file)
#   deploy/local/cluster.sh down   [--dir DIR]
#   deploy/local/cluster.sh status [--dir DIR]
#   deploy/local/cluster.sh restart NAME [--dir DIR]   (NAME: store, prefill-0, decode-1, router...;
#                                  stops it if it runs, starts it again with the same flags)
#   deploy/local/cluster.sh drain NAME [--dir DIR]     (a prefill or decode node leaves: SIGTERM,
#                                  then waits for it to exit. It deregisters, takes nothing new,
#                                  lets its requests finish for up to --drain_timeout_s (30 s;
#                                  `up --node-flag --drain_timeout_s=5` sets it) and hands the
#                                  rest off to other nodes through the store)
#
# `up` returns once the router answers /health (every node reachable), printing the HTTP address;
# then use it with curl or any OpenAI client:
#   curl -N localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
#     -d '{"model":"strata-tiny","messages":[{"role":"user","content":"Hi"}],"stream":true}'
# Logs: DIR/logs/*.log; cluster file: DIR/cluster.json; pids: DIR/pids. Binaries come from
# build/ (STRATA_BUILD_DIR overrides); scripts/build.sh builds them.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${STRATA_BUILD_DIR:-$root/build}"

cmd="${1:-}"
[ -n "$cmd" ] && shift
target=""
if { [ "$cmd" = restart ] || [ "$cmd" = drain ]; } && [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then target="$1"; shift; fi
dir="${STRATA_CLUSTER_DIR:-/tmp/strata-cluster}"
codec="kivi:k4v4:g32"
chunk=64
n_prefill=2
n_decode=2
port_base=7700
http_port=8000
model="$root/models/strata-tiny"
calibration=""
kv_budget="256M"
max_batch=32
store_ram="512M"
store_disk="4G"
prefill_local="0"
decode_local="0"
etcd=""
etcd_ttl=6
netns=""
tls=""
shared_tier=0
shared_tier_memory="256mb"
host_stores=0
extra_router=()
extra_node=()
extra_decode=()
decode_bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift ;;
    --codec) codec="$2"; shift ;;
    --chunk) chunk="$2"; shift ;;
    --prefill) n_prefill="$2"; shift ;;
    --decode) n_decode="$2"; shift ;;
    --port-base) port_base="$2"; shift ;;
    --http-port) http_port="$2"; shift ;;
    --model) model="$2"; shift ;;
    --calibration) calibration="$2"; shift ;;
    --kv-budget) kv_budget="$2"; shift ;;
    --max-batch) max_batch="$2"; shift ;;
    --store-ram) store_ram="$2"; shift ;;
    --store-disk) store_disk="$2"; shift ;;
    --prefill-local-ram) prefill_local="$2"; shift ;;
    --decode-local-ram) decode_local="$2"; shift ;;
    --etcd) etcd="$2"; shift ;;
    --etcd-ttl) etcd_ttl="$2"; shift ;;
    --netns) netns="$2"; shift ;;
    --tls) tls="$2"; shift ;;
    --shared-tier) shared_tier="$2"; shift ;;
    --shared-tier-memory) shared_tier_memory="$2"; shift ;;
    --host-stores) host_stores=1 ;;
    --router-flag) extra_router+=("$2"); shift ;;
    --node-flag) extra_node+=("$2"); shift ;;
    --decode-flag) extra_decode+=("$2"); shift ;;
    --decode-bin) decode_bin="$2"; shift ;;
    -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
    *) echo "cluster.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$host_stores" = 1 ] && [ "$n_prefill" -gt 50 -o "$n_decode" -gt 50 ]; then
  echo "cluster.sh: --host-stores takes at most 50 hosts" >&2; exit 2
fi

stop_all() {
  [ -f "$dir/pids" ] || return 0
  local pids
  pids="$(awk '{print $2}' "$dir/pids")"
  # Router first (clients get their errors), then nodes, then the store.
  for pid in $(tac "$dir/pids" | awk '{print $2}'); do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 100); do
    local alive=0
    for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -f "$dir/pids"
  if [ -f "$dir/netns" ]; then  # the hosts, once nothing runs in them; the hub when unused
    read -r hub own_hub hosts <"$dir/netns"
    # shellcheck disable=SC2086
    "$root/deploy/netns/hosts.sh" del $hosts || true
    if [ "$own_hub" = 1 ]; then "$root/deploy/netns/hosts.sh" gc "$hub" || true; fi
    rm -f "$dir/netns"
  fi
}

# The host NAME runs on. With --host-stores, host I holds prefill-I, decode-I and store-I (host 0
# the cluster's store); otherwise each process is a host of its own. The Redis Cluster of
# --shared-tier is one more host, "redis".
host_key() {
  if [ "$host_stores" = 1 ]; then
    case "$1" in
      store) echo host-0; return ;;
      prefill-*) echo "host-${1#prefill-}"; return ;;
      decode-*) echo "host-${1#decode-}"; return ;;
      store-*) echo "host-${1#store-}"; return ;;
    esac
  fi
  echo "$1"
}
# Where NAME (store, store-I, prefill-I, decode-I, router, redis) runs: 127.0.0.1, or with --netns
# its host's address (10.77.B.N, B from the port base so that clusters on one hub differ).
host_of() {
  if [ -z "$netns" ]; then echo 127.0.0.1; return; fi
  local n key
  key="$(host_key "$1")"
  case "$key" in
    store) n=2 ;;
    router) n=3 ;;
    redis) n=4 ;;
    prefill-*) n=$((10 + ${key#prefill-})) ;;
    decode-*) n=$((100 + ${key#decode-})) ;;
    host-*) n=$((10 + ${key#host-})) ;;
  esac
  echo "10.77.$(( (port_base / 100) % 250 + 1 )).$n"
}
ns_of() { echo "$netns-$port_base-$(host_key "$1")"; }
# Runs CMD in the namespace clients use (the hub), or here.
client() { if [ -n "$netns" ]; then ip netns exec "$netns" "$@"; else "$@"; fi; }

wait_for() {  # wait_for NAME PID: until its log says "serving on"
  local name="$1" pid="$2"
  for _ in $(seq 300); do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "cluster.sh: $name exited; its log ($dir/logs/$name.log) ends:" >&2
      tail -n 20 "$dir/logs/$name.log" >&2
      return 1
    fi
    if grep -q "serving on" "$dir/logs/$name.log" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "cluster.sh: $name did not start within 30 s ($dir/logs/$name.log)" >&2
  return 1
}

case "$cmd" in
  up)
    for b in kvstore/strata-store prefill_node/strata-prefill decode_node/strata-decode router/strata-router; do
      [ -x "$bin/$b" ] || { echo "cluster.sh: $bin/$b is missing: run scripts/build.sh first" >&2; exit 1; }
    done
    if [ -f "$dir/pids" ]; then stop_all; fi
    mkdir -p "$dir/logs"
    rm -rf "$dir/store"
    store_port=$port_base
    names=(store router)
    for i in $(seq 0 $((n_prefill - 1))); do names+=("prefill-$i"); done
    for i in $(seq 0 $((n_decode - 1))); do names+=("decode-$i"); done
    hosts_n=$(( n_prefill > n_decode ? n_prefill : n_decode ))
    if [ "$host_stores" = 1 ]; then
      for i in $(seq 1 $((hosts_n - 1))); do names+=("store-$i"); done
    fi
    [ "$shared_tier" -gt 0 ] && names+=(redis)
    # Where each process runs (NAME NAMESPACE ADDRESS; the namespace is "-" on loopback): for
    # tests and for `ip netns exec`.
    for name in "${names[@]}"; do
      echo "$name $([ -n "$netns" ] && ns_of "$name" || echo -) $(host_of "$name")"
    done >"$dir/hosts"
    if [ -n "$netns" ]; then
      "$root/deploy/netns/hosts.sh" check
      own_hub=0  # a hub made here goes with the cluster; one made before (tests run in it) stays
      ip netns list | awk '{print $1}' | grep -qx "$netns" || own_hub=1
      "$root/deploy/netns/hosts.sh" hub "$netns"
      hosts=""
      for name in "${names[@]}"; do
        case " $hosts " in *" $(ns_of "$name") "*) continue ;; esac  # a host of several processes
        "$root/deploy/netns/hosts.sh" add "$netns" "$(ns_of "$name")" "$(host_of "$name")"
        hosts="$hosts $(ns_of "$name")"
      done
      echo "$netns $own_hub$hosts" >"$dir/netns"
    fi
    # --host-stores: the "store" of a node on host I > 0 (its host's store-I); "" otherwise.
    store_field() {
      if [ "$host_stores" = 1 ] && [ "$1" -gt 0 ]; then
        printf ', "store": "%s:%d"' "$(host_of "store-$1")" $((port_base + 100 + $1))
      fi
    }
    {
      echo "{"
      echo "  \"model\": \"$model\","
      echo "  \"codec\": \"$codec\","
      echo "  \"chunk_tokens\": $chunk,"
      echo "  \"calibration\": \"$calibration\","
      echo "  \"store\": \"$(host_of store):$store_port\","
      echo "  \"nodes\": ["
      sep=""
      for i in $(seq 0 $((n_prefill - 1))); do
        h="$(host_of "prefill-$i")"
        printf '%s    {"id": "prefill-%d", "role": "prefill", "grpc": "%s:%d", "metrics": "%s:%d"%s}' \
          "$sep" "$i" "$h" $((port_base + 10 + i)) "$h" $((port_base + 20 + i)) "$(store_field "$i")"
        sep=$',\n'
      done
      for i in $(seq 0 $((n_decode - 1))); do
        # The UCX transport on any free port: the node announces its address with every request,
        # and a restarted node never waits for its old connections' TIME_WAIT.
        h="$(host_of "decode-$i")"
        printf '%s    {"id": "decode-%d", "role": "decode", "grpc": "%s:%d", "transport": "%s:0", "metrics": "%s:%d"%s}' \
          "$sep" "$i" "$h" $((port_base + 30 + i)) "$h" "$h" $((port_base + 50 + i)) "$(store_field "$i")"
      done
      echo ""
      echo "  ],"
      echo "  \"router\": {\"http\": \"$(host_of router):$http_port\"}"
      echo "}"
    } >"$dir/cluster.json"
    : >"$dir/pids"
    start() {  # start NAME CMD...
      local name="$1"; shift
      if [ -n "$netns" ]; then set -- ip netns exec "$(ns_of "$name")" "$@"; fi
      printf '%q ' "$@" >"$dir/cmd.$name"  # for `restart`
      "$@" >"$dir/logs/$name.log" 2>&1 &
      echo "$name $!" >>"$dir/pids"
      wait_for "$name" "$!" || { stop_all; exit 1; }
    }
    store_tiers=(--ram_bytes "$store_ram")
    if [ "$store_disk" != "0" ]; then
      store_tiers+=(--disk_path "$dir/store" --disk_bytes "$store_disk")
    fi
    node_etcd=()
    store_etcd=()
    # Separate hosts share no memory: UCX over TCP, blocks crossing the veth links (on one host
    # UCX would pick shared memory even across namespaces).
    node_net=()
    if [ -n "$netns" ]; then node_net=(--ucx_tls tcp); fi
    if [ -n "$etcd" ]; then
      node_etcd=(--etcd "$etcd" --etcd_prefix "/strata/$(basename "$dir")/" --etcd_ttl_s "$etcd_ttl")
      store_etcd=("${node_etcd[@]}")  # the stores register too (stores/<id>)
      extra_router+=(--etcd "$etcd" --etcd_prefix "/strata/$(basename "$dir")/")
    fi
    # Transport security (docs/deploy.md, "Security"): mutual TLS and the cluster token, or
    # --insecure, which every process then logs as a warning.
    if [ -n "$tls" ]; then
      mkdir -p "$tls"
      tls="$(cd "$tls" && pwd)"
      if [ ! -f "$tls/ca.crt" ]; then
        sans=()
        for name in store router $(seq -f 'prefill-%g' 0 $((n_prefill - 1))) \
                    $(seq -f 'decode-%g' 0 $((n_decode - 1))); do
          sans+=(--san "$(host_of "$name")")
        done
        if [ "$shared_tier" -gt 0 ]; then sans+=(--san "$(host_of redis)"); fi
        "$root/scripts/make_certs.sh" "$tls" "${sans[@]}" >/dev/null
      fi
      sec=(--tls_cert "$tls/node.crt" --tls_key "$tls/node.key" --tls_ca "$tls/ca.crt"
           --cluster_token_file "$tls/cluster.token")
      router_sec=("${sec[@]}" --http_tls_cert "$tls/router-http.crt"
                  --http_tls_key "$tls/router-http.key")
      scheme=https
      curl_tls=(--cacert "$tls/ca.crt")
    else
      sec=(--insecure)
      router_sec=(--insecure)
      scheme=http
      curl_tls=()
    fi
    # The shared tier: a Redis Cluster of N masters with a replica each, before the store.
    store_shared=()
    if [ "$shared_tier" -gt 0 ]; then
      command -v redis-server >/dev/null && command -v redis-cli >/dev/null ||
        { echo "cluster.sh: --shared-tier needs redis-server and redis-cli (scripts/setup.sh installs them)" >&2; stop_all; exit 1; }
      redis_host="$(host_of redis)"
      # A command prefix, not a function: `$!` must be redis-server's own pid (ip netns exec
      # execs it), for `down` and for tests that kill a master.
      on_redis=()
      if [ -n "$netns" ]; then on_redis=(ip netns exec "$(ns_of redis)"); fi
      # With --tls: TLS only (the node certificate serves Redis too; clients must present one
      # signed by the cluster's CA) and AUTH with DIR/redis.password, replicas included.
      redis_cli=("${on_redis[@]}" redis-cli)
      tier_sec=()
      if [ -n "$tls" ]; then
        if [ ! -s "$tls/redis.password" ]; then
          (umask 077 && openssl rand -hex 32 >"$tls/redis.password")
        fi
        redis_password="$(head -n1 "$tls/redis.password")"
        redis_cli=("${on_redis[@]}" env REDISCLI_AUTH="$redis_password" redis-cli --tls
                   --cacert "$tls/ca.crt" --cert "$tls/node.crt" --key "$tls/node.key")
        tier_sec=(--shared_tier_tls --shared_tier_tls_ca "$tls/ca.crt"
                  --shared_tier_tls_cert "$tls/node.crt" --shared_tier_tls_key "$tls/node.key"
                  --shared_tier_password_file "$tls/redis.password")
      fi
      redis_addrs=()
      for i in $(seq 0 $((2 * shared_tier - 1))); do
        p=$((port_base + 200 + i))
        rm -rf "$dir/redis-$i" && mkdir -p "$dir/redis-$i"
        if [ -n "$tls" ]; then
          redis_sec=(--port 0 --tls-port "$p" --tls-cluster yes --tls-replication yes
                     --tls-cert-file "$tls/node.crt" --tls-key-file "$tls/node.key"
                     --tls-ca-cert-file "$tls/ca.crt" --tls-auth-clients yes
                     --requirepass "$redis_password" --masterauth "$redis_password")
        else
          redis_sec=(--port "$p")
        fi
        "${on_redis[@]}" redis-server "${redis_sec[@]}" --bind "$redis_host" --cluster-enabled yes \
          --cluster-config-file "$dir/redis-$i/nodes.conf" --dir "$dir/redis-$i" \
          --cluster-node-timeout 2000 --save '' --appendonly no --repl-diskless-sync-delay 0 --protected-mode no \
          --maxmemory "$shared_tier_memory" --maxmemory-policy volatile-lru \
          --logfile "$dir/logs/redis-$i.log" </dev/null >/dev/null 2>&1 &
        echo "redis-$i $!" >>"$dir/pids"
        redis_addrs+=("$redis_host:$p")
      done
      for a in "${redis_addrs[@]}"; do
        for _ in $(seq 100); do "${redis_cli[@]}" -h "$redis_host" -p "${a##*:}" PING 2>/dev/null | grep -q PONG && break; sleep 0.05; done
      done
      "${redis_cli[@]}" --cluster create "${redis_addrs[@]}" --cluster-replicas 1 --cluster-yes \
        >"$dir/logs/redis-create.log" 2>&1 ||
        { echo "cluster.sh: redis-cli --cluster create failed ($dir/logs/redis-create.log)" >&2; stop_all; exit 1; }
      for _ in $(seq 200); do
        "${redis_cli[@]}" -h "$redis_host" -p "${redis_addrs[0]##*:}" CLUSTER INFO 2>/dev/null | grep -q cluster_state:ok && break
        sleep 0.05
      done
      store_shared=(--shared_tier "$(IFS=,; echo "${redis_addrs[*]}")" "${tier_sec[@]}")
    fi
    start store "$bin/kvstore/strata-store" --listen "$(host_of store):$store_port" "${store_tiers[@]}" \
      --metrics_host "$(host_of store)" --metrics_port $((port_base + 1)) "${sec[@]}" \
      "${store_shared[@]}" "${store_etcd[@]}"
    if [ "$host_stores" = 1 ]; then
      for i in $(seq 1 $((hosts_n - 1))); do
        tiers=(--ram_bytes "$store_ram")
        if [ "$store_disk" != "0" ]; then
          rm -rf "$dir/store-$i"
          tiers+=(--disk_path "$dir/store-$i" --disk_bytes "$store_disk")
        fi
        start "store-$i" "$bin/kvstore/strata-store" --listen "$(host_of "store-$i"):$((port_base + 100 + i))" \
          "${tiers[@]}" --metrics_host "$(host_of "store-$i")" --metrics_port $((port_base + 150 + i)) "${sec[@]}" \
          "${store_shared[@]}" "${store_etcd[@]}"
      done
    fi
    for i in $(seq 0 $((n_prefill - 1))); do
      start "prefill-$i" "$bin/prefill_node/strata-prefill" --cluster "$dir/cluster.json" --node "prefill-$i" \
        --local_ram_bytes "$prefill_local" "${node_etcd[@]}" "${node_net[@]}" "${sec[@]}" \
        "${store_shared[@]}" "${extra_node[@]}"
    done
    for i in $(seq 0 $((n_decode - 1))); do
      start "decode-$i" "${decode_bin:-$bin/decode_node/strata-decode}" --cluster "$dir/cluster.json" \
        --node "decode-$i" --kv_budget "$kv_budget" --max_batch "$max_batch" \
        --local_ram_bytes "$decode_local" "${node_etcd[@]}" "${node_net[@]}" "${sec[@]}" \
        "${store_shared[@]}" "${extra_node[@]}" "${extra_decode[@]}"
    done
    start router "$bin/router/strata-router" --cluster "$dir/cluster.json" "${extra_router[@]}" \
      "${router_sec[@]}" "${store_shared[@]}"
    router_url="$scheme://$(host_of router):$http_port"
    for _ in $(seq 100); do
      if client curl -sf "${curl_tls[@]}" "$router_url/health" >/dev/null; then
        where=""
        [ -n "$netns" ] && where=" (from namespace $netns: ip netns exec $netns curl ...)"
        shared=""
        [ "$shared_tier" -gt 0 ] && shared=", shared tier: $shared_tier Redis masters"
        echo "cluster.sh: up: $router_url$where (codec $codec, $n_prefill prefill, $n_decode decode$shared; $dir)"
        exit 0
      fi
      sleep 0.1
    done
    echo "cluster.sh: the router is not healthy after 10 s:" >&2
    client curl -s "${curl_tls[@]}" "$router_url/health" >&2 || true
    stop_all
    exit 1
    ;;
  down)
    stop_all
    echo "cluster.sh: down"
    ;;
  restart)
    [ -n "$target" ] || { echo "usage: cluster.sh restart NAME [--dir DIR]" >&2; exit 2; }
    [ -f "$dir/cmd.$target" ] || { echo "cluster.sh: no process $target in $dir" >&2; exit 1; }
    old_pid="$(awk -v n="$target" '$1 == n {print $2}' "$dir/pids")"
    if [ -n "$old_pid" ] && kill -0 "$old_pid" 2>/dev/null; then
      kill -TERM "$old_pid" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$old_pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$old_pid" 2>/dev/null || true
    fi
    # exec: the background subshell becomes the process, so that $! (and `down`) name it.
    eval "exec $(cat "$dir/cmd.$target")" >"$dir/logs/$target.log" 2>&1 &
    new_pid=$!
    awk -v n="$target" -v p="$new_pid" '$1 == n {$2 = p} {print}' "$dir/pids" >"$dir/pids.new"
    mv "$dir/pids.new" "$dir/pids"
    wait_for "$target" "$new_pid" || exit 1
    echo "cluster.sh: $target restarted (pid $new_pid)"
    ;;
  drain)
    [ -n "$target" ] || { echo "usage: cluster.sh drain NAME [--dir DIR]" >&2; exit 2; }
    pid="$(awk -v n="$target" '$1 == n {print $2}' "$dir/pids" 2>/dev/null)"
    { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; } || { echo "cluster.sh: $target is not running" >&2; exit 1; }
    kill -TERM "$pid"
    for _ in $(seq 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then echo "cluster.sh: $target still runs after 120 s" >&2; exit 1; fi
    grep -E "draining|drained|handed" "$dir/logs/$target.log" | tail -n 3 || true
    echo "cluster.sh: $target drained and exited"
    ;;
  status)
    [ -f "$dir/pids" ] || { echo "cluster.sh: no cluster in $dir"; exit 1; }
    while read -r name pid; do
      if kill -0 "$pid" 2>/dev/null; then echo "$name $pid running"; else echo "$name $pid exited"; fi
    done <"$dir/pids"
    ;;
  *)
    echo "usage: cluster.sh up|down|status|restart NAME|drain NAME [flags] (see --help)" >&2
    exit 2
    ;;
esac
