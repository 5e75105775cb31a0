#!/usr/bin/env bash
# Installs what tools/train_model.py and the codec report need (Debian's PyTorch, NumPy, regex
# and matplotlib for Python 3, and the text the second model's corpus adds: the GCIDE dictionary
# and Python's documentation), on
# top of scripts/setup.sh. Idempotent. Kept apart from setup.sh because PyTorch is large and
# neither the build nor the tests need it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
packages=(python3-torch python3-numpy python3-regex python3-matplotlib dict-gcide python3-doc)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && { echo "setup_training: all present"; exit 0; }
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
