#!/usr/bin/env bash
# tools/train_model.py's two halves on a tiny run (the smoke preset, 2 M characters, 3 steps):
# data prepared without PyTorch (--prepare-only), a model trained from it (--data), exported in
# the layout model/ loads, and strata ppl computing its held-out perplexity. Exits 77 (CTest:
# skipped) without Debian's python3-torch or python3-regex (scripts/setup_training.sh).
#   train_model_pipeline.sh PATH_TO_STRATA
set -euo pipefail
strata="$1"
cd "$(dirname "$0")/../.."
/usr/bin/python3 -c "import regex" 2>/dev/null ||
  { echo "skipped: no python3-regex (scripts/setup_training.sh)"; exit 77; }
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
/usr/bin/python3 tools/train_model.py --out "$dir/data" --preset smoke --corpus debian-docs+dict \
  --corpus-bytes 2000000 --tokenizer-bytes 300000 --prepare-only
for f in data.json tokenizer.json train.u16.xz heldout.u16 heldout.txt calibration.txt; do
  [ -s "$dir/data/$f" ] || { echo "prepare wrote no $f"; exit 1; }
done
/usr/bin/python3 -c "import torch" 2>/dev/null ||
  { echo "skipped after prepare: no python3-torch (scripts/setup_training.sh)"; exit 77; }
/usr/bin/python3 tools/train_model.py --out "$dir/model" --preset smoke --data "$dir/data" \
  --steps 3 --batch 2
# A second phase from the exported weights, each window opening with <|begin_of_text|>: the card
# says what it continued from.
/usr/bin/python3 tools/train_model.py --out "$dir/model2" --preset smoke --data "$dir/data" \
  --init "$dir/model" --bos-windows --steps 2 --batch 2
grep -q "continued from $dir/model (itself 3 steps" "$dir/model2/README.md" ||
  { echo "the second phase's card does not say what it continued from"; exit 1; }
# Weights of another shape are refused, naming what is missing.
if /usr/bin/python3 tools/train_model.py --out "$dir/bad" --preset strata-small --data "$dir/data" \
     --init "$dir/model" --steps 1 2>"$dir/err"; then
  echo "weights of another preset were taken"; exit 1
fi
grep -q "not a strata-small model" "$dir/err" || { cat "$dir/err"; exit 1; }
# A damaged prepared file is refused, naming it.
printf 'x' >>"$dir/data/heldout.u16"
if /usr/bin/python3 tools/train_model.py --out "$dir/bad" --preset smoke --data "$dir/data" \
     --steps 1 2>"$dir/err"; then
  echo "a damaged heldout.u16 was not refused"; exit 1
fi
grep -q "heldout.u16: its SHA-256" "$dir/err" || { cat "$dir/err"; exit 1; }
out="$("$strata" ppl --model "$dir/model" --context 64 --windows 2 "$dir/model/heldout.txt")"
echo "$out"
echo "$out" | grep -q "^perplexity [0-9.]* over" || exit 1
echo "train_model pipeline: ok"
