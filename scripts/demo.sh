#!/usr/bin/env bash
# Sets up, builds and runs Strata's main job on this machine (no GPU needed): a local cluster as
# separate processes on loopback (strata-store, 2 prefill nodes, 2 decode nodes, strata-router
# with its OpenAI-compatible API) serving the bundled model; a multi-turn chat workload through
# the HTTP API, printing per turn the time to first token, cached prompt tokens, KV bytes shipped
# against fp16 and the nodes that served it; every reply checked against single-process
# `strata generate` with the same codec; then everything stops.
#   scripts/demo.sh [--codec SPEC] [--port-base P] [--http-port P]
# (the old single-process synthetic demo is `build/tools/strata demo`)
set -euo pipefail
cd "$(dirname "$0")/.."
codec="kivi:k4v4:g32"
port_base=7700
http_port=8000
while [ $# -gt 0 ]; do
  case "$1" in
    --codec) codec="$2"; shift ;;
    --port-base) port_base="$2"; shift ;;
    --http-port) http_port="$2"; shift ;;
    *) echo "demo.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
./scripts/setup.sh
./scripts/build.sh --target strata --target strata-store --target strata-prefill \
  --target strata-decode --target strata-router
dir="$(mktemp -d /tmp/strata-demo.XXXXXX)"
trap 'deploy/local/cluster.sh down --dir "$dir" >/dev/null; echo "demo: logs in $dir/logs"' EXIT
deploy/local/cluster.sh up --dir "$dir" --codec "$codec" --chunk 64 \
  --port-base "$port_base" --http-port "$http_port"
/usr/bin/python3 tools/cluster_demo.py --cluster "$dir/cluster.json" --strata build/tools/strata
