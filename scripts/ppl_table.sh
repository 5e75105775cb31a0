#!/usr/bin/env bash
# Perplexity of the bundled model on its held-out split with the KV cache at fp16 and compressed
# by each codec (prefill chunk by chunk, each chunk attending over the compressed earlier ones).
# Writes the table to bench/results/ppl-<date>-<commit>.txt.
#   scripts/ppl_table.sh [MODEL_DIR] [CONTEXT] [WINDOWS]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-models/strata-tiny}"
context="${2:-2048}"
windows="${3:-4}"
./scripts/build.sh --target strata >/dev/null
commit="$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)"
out="bench/results/ppl-$(date -u +%Y-%m-%d)-${commit}.txt"
codecs=(fp16 bf16 int8 fp8e4m3 kivi:k8v8:g32 kivi:k4v4:g32 kivi:k3v3:g32 kivi:k2v2:g32
        kivi:k2v2:g128 kcvt:k4v4 kcvt:k2v2 gearl:k2v2:g32:r4 gearl:k2v2:kcvt:r4
        gear:k2v2:kcvt:r2:s1 gear:k2v2:kcvt:r4:s2 gear:k2v2:g32:r4:s2 gear:k4v4:g32:r4:s2
        zipcache:k2v2:h4:s10 kivi:k2v2:g32:m8 kivi:k2v2:g32:sink4 tada:k2v2:g32)
# (SKVQ and the Strata mix need a calibration: scripts/codec_report.sh runs them.)
{
  echo "model $model, held-out text $model/heldout.txt, context $context, $windows windows, commit $commit, $(date -u +%FT%TZ)"
  for c in "${codecs[@]}"; do
    ./build/tools/strata ppl --model "$model" --codec "$c" --context "$context" \
      --windows "$windows" "$model/heldout.txt"
  done
} | tee "$out"
echo "wrote $out"
