#!/usr/bin/env bash
# The working tree a lent GPU machine receives (the device tool sends the tracked files and the
# carried folders, 64 MiB at most) without the second bundled model's 63 MB of weights, which no
# GPU bundle needs:
#   scripts/lean_tree.sh on     models/strata-small leaves this checkout's working tree (git
#                               sparse-checkout; the files stay committed, in .git)
#   scripts/lean_tree.sh off    it comes back (do this before building or testing here: its
#                               tests skip, saying so, while it is away)
#   scripts/lean_tree.sh size   the bytes a call would send now, before any carried folder
set -euo pipefail
cd "$(dirname "$0")/.."
hidden=(models/strata-small)
case "${1:-}" in
  on)
    git sparse-checkout set --no-cone '/*' $(printf -- "!/%s/ " "${hidden[@]}")
    ;;
  off)
    git sparse-checkout disable
    ;;
  size)
    # Tracked files present in the working tree, and untracked ones git does not ignore.
    git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
      du -cb --files0-from=- | tail -n 1 | awk '{printf "%.1f MiB would travel (limit 64 MiB)\n", $1 / 1048576}'
    ;;
  *)
    sed -n '2,11p' "$0" >&2
    exit 2
    ;;
esac
