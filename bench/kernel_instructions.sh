#!/usr/bin/env bash
# Instructions the decode attention kernels execute, counted by valgrind's callgrind: a figure
# that does not move with a shared VM's noisy clock, for comparing two versions of a kernel.
# Runs codec_bench's attention table (2048 tokens; its repetition counts are fixed) under
# callgrind, collecting only inside the functions whose names match PATTERN, and prints the
# instructions of each function executed there, summed over its source lines (inlined code
# counts to the function it was inlined into; real calls, such as memset, on their own).
#   bench/kernel_instructions.sh [BUILD_DIR] [CODECS] [PATTERN]
#   (defaults: build, kivi:k2v2:g32,kivi:k4v4:g32, *integer_avx2::*)
# PATTERN "tasks": all of the attention's work, the tasks DecodeAttention runs on its thread
# pool, on every thread (not DecodeAttention(*: the pool's other thread runs outside it, and
# how the tasks fall to threads varies from run to run).
# Needs valgrind (AVX2 is emulated; AVX-512 is not, so this counts the AVX2 paths).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
codecs="${2:-kivi:k2v2:g32,kivi:k4v4:g32}"
pattern="${3:-*integer_avx2::*}"
[ "$pattern" = tasks ] && pattern='*Run(strata::kernels::DecodeAttentionParams*_M_invoke*'
command -v valgrind >/dev/null || { echo "kernel_instructions: needs valgrind" >&2; exit 2; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
echo "# codec_bench --tables 2 --codecs $codecs --contexts 2048 under callgrind;"
echo "# collected in: $pattern; commit $(git rev-parse --short HEAD)$(git diff --quiet || echo +)"
valgrind --tool=callgrind --callgrind-out-file="$out/cg" \
  --toggle-collect="$pattern" "$build/bench/codec_bench" --tables 2 --codecs "$codecs" \
  --contexts 2048 --isa "${ISA:-avx2}" --out "$out" >"$out/bench.txt" 2>"$out/valgrind.txt"
# Each line of callgrind_annotate is "Ir  file:function [object]"; sum by function.
callgrind_annotate --show-percs=no --inclusive=no --auto=no "$out/cg" |
  grep -E '^ *[0-9,]+ +[^ ]' |
  sed -E 's/^ *([0-9,]+) +(.*)$/\1\t\2/' |
  awk -F'\t' '{
    n = $1; gsub(",", "", n); f = $2
    sub(/^[^:]*:/, "", f); sub(/ \[[^]]*\]$/, "", f); sub(/ \([0-9,]+x\)$/, "", f)
    if (f ~ /events annotated/ || f == "") next
    if (f ~ /PROGRAM TOTALS/) f = "(all collected)"
    sum[f] += n
  } END { for (f in sum) printf "%16.0f  %s\n", sum[f], f }' |
  sort -rn | head -20
