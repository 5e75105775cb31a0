#!/usr/bin/env bash
# Sets up, builds and runs Strata's main job on this machine: `strata demo` (no GPU needed).
#   scripts/demo.sh [strata demo flags, e.g. --out DIR --layers 8]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh --target strata
exec ./build/tools/strata demo "$@"
