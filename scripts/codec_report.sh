#!/usr/bin/env bash
# The codec quality report on the bundled model: every method and the Strata mix on the held-out
# split (calibrating on the model's calibration.txt, disjoint from it), as a table, JSON and the
# Pareto chart, in bench/results/codec-report-<date>-<commit>.{txt,json,png}.
#   scripts/codec_report.sh [MODEL_DIR] [CONTEXT] [WINDOWS] [CONTINUATIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-models/strata-tiny}"
context="${2:-2048}"
continuations="${4:-8}"
windows="${3:-4}"
./scripts/setup_training.sh >/dev/null  # python3-matplotlib for the chart
./scripts/build.sh --target strata >/dev/null
commit="$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)"
base="bench/results/codec-report-$(basename "$model")-$(date -u +%Y-%m-%d)-${commit}"
codecs=(fp16 int8 fp8e4m3
        kivi:k4v4:g32 kivi:k3v3:g32 kivi:k2v2:g32 kivi:k2v2:g64 kivi:k2v2:g32:m8
        kcvt:k4v4 kcvt:k2v2 kcvt:k2v2:m8
        gearl:k2v2:kcvt:r2 gear:k2v2:kcvt:r2:s1 gear:k2v2:g64:r2:s1 gear:k4v4:kcvt:r2:s1
        zipcache:k2v2:h4:s10 zipcache:k2v2:h8:s10 zipcache:k3v3:h8:s10 zipcache:k2v2:h4:s10:m8
        skvq:k2v2:g32 skvq:k2v2:g64 skvq:k2v2:g32:m8 skvq:k3v3:g32:m8 skvq:k4v4:g32
        tada:k2v2:g32 tada:k4v4:g32 tada:k3v3:g32
        kivi:k2v2:g32:sink4 skvq:k2v2:g32:sink4
        int8:rot kivi:k4v4:g32:rot kivi:k2v2:g32:rot kcvt:k2v2:rot
        cq:c2:b8:sink4 cq:c2:b6:sink4 cq:c4:b8:sink4 cq:c4:b8 cq:c4:b6 cq:c8:b8
        strata:b1.6 strata:b2.25 strata:b2.5 strata:b3 strata:b4)
IFS=,
{
  echo "machine $(uname -m) $(nproc) cores, $(date -u +%FT%TZ), commit $commit"
  ./build/tools/strata eval --model "$model" --codecs "${codecs[*]}" --context "$context" \
    --windows "$windows" --continuations "$continuations" --calib_text "$model/calibration.txt" --json "$base.json" \
    "$model/heldout.txt"
} | tee "$base.txt"
/usr/bin/python3 tools/pareto_chart.py "$base.json" "$base.png"
