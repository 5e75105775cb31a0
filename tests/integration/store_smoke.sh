#!/usr/bin/env bash
# strata-store as a user starts it: a real process with a disk tier, its Prometheus endpoint
# answering, a clean stop on SIGTERM. Usage: store_smoke.sh PATH_TO_STRATA_STORE
set -euo pipefail
bin="$1"
dir="$(mktemp -d)"
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
"$bin" --listen 127.0.0.1:0 --ram_bytes 64M --disk_path "$dir/db" --disk_bytes 1G \
  --metrics_port 0 --insecure >"$dir/out" 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q "serving on port" "$dir/out" && break; sleep 0.1; done
grep -q "serving on port" "$dir/out" || { cat "$dir/out"; exit 1; }
mport="$(sed -n 's/.*metrics on port \([0-9]*\).*/\1/p' "$dir/out")"
exec 3<>"/dev/tcp/127.0.0.1/$mport"
printf 'GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n' >&3
resp="$(cat <&3)"
echo "$resp" | grep -q "strata_store_disk_blocks 0" || { echo "$resp"; exit 1; }
kill -TERM "$pid"
wait "$pid"
grep -q "strata-store: stopped" "$dir/out"
echo "strata-store smoke: ok"
