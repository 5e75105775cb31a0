#!/usr/bin/env bash
# Instructions a codec's compression executes, counted by valgrind's callgrind: a figure that
# does not move with a shared VM's noisy clock, for comparing two builds of the encoders.
# Runs codec_bench's compression table (32 chunks, three repetitions on one thread and three on
# the pool: fixed counts) once per codec and once with fp16 alone, and prints each codec's
# instructions less the fp16 run's (the setup and fp16's own copy cost the same in both).
#   bench/compression_instructions.sh CODEC_BENCH [CODEC_BENCH_2] [CODECS]
#   (CODECS default: gear:k2v2:kcvt:r2:s1,gearl:k2v2:g32:r4,gear:k2v2:g32:r4:s2,skvq:k2v2:g32)
# With two binaries (a build before a change and one after) it prints both and their ratio.
# Needs valgrind (AVX2 is emulated; AVX-512 is not, so this counts the AVX2 paths).
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,11p' "$0"; exit 2; }
bins=("$1")
codecs="gear:k2v2:kcvt:r2:s1,gearl:k2v2:g32:r4,gear:k2v2:g32:r4:s2,skvq:k2v2:g32"
if [ $# -ge 2 ]; then
  if [ -x "$2" ]; then bins+=("$2"); [ $# -ge 3 ] && codecs="$3"; else codecs="$2"; fi
fi
command -v valgrind >/dev/null || { echo "compression_instructions: needs valgrind" >&2; exit 2; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# count BIN CODEC: the run's instructions (Ir).
count() {
  valgrind --tool=callgrind --callgrind-out-file="$out/cg" \
    "$1" --tables 1 --codecs "$2" --isa "${ISA:-avx2}" --out "$out" >/dev/null 2>"$out/valgrind.txt"
  grep -o 'refs: *[0-9,]*' "$out/valgrind.txt" | tr -d 'refs:, '
}
echo "# codec_bench --tables 1 under callgrind, instructions less the fp16 run's; $(date -u +%F)"
for b in "${bins[@]}"; do echo "# $b"; done
declare -A base
for b in "${bins[@]}"; do base[$b]="$(count "$b" fp16)"; done
for c in ${codecs//,/ }; do
  line="$(printf '%-24s' "$c")"
  first=""
  for b in "${bins[@]}"; do
    n=$(( $(count "$b" "$c") - ${base[$b]} ))
    line+="$(printf ' %14d' "$n")"
    if [ -z "$first" ]; then first=$n; else line+="$(awk -v a="$n" -v b="$first" 'BEGIN{printf "  %.3fx", a / b}')"; fi
  done
  echo "$line"
done
