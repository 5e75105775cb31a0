#!/usr/bin/env bash
# Sets up, builds and runs Strata's whole test suite: the unit tests under ASan+UBSan and under
# TSan (CPU code, built with clang), then every test of the default build (CUDA targets too when
# nvcc is present; GPU tests skip without a GPU and say why). Where no GPU is visible the CUDA code
# is compiled as PTX only (scripts/build.sh), a third of the compile time: it checks that it
# compiles, which is all a machine without a GPU can check. The last line is ctest's summary
# for the default build.
#   scripts/test.sh [--no-sanitizers]
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizers=1
[ "${1:-}" = "--no-sanitizers" ] && sanitizers=0
jobs="$(nproc)"

./scripts/setup.sh
start=$SECONDS
if [ "$sanitizers" = 1 ]; then
  ./scripts/build.sh --asan --cpu-only --target strata_unit_tests
  echo "== ASan+UBSan build: unit tests"
  (cd build-asan-cpu && ASAN_OPTIONS=detect_leaks=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     ctest -L unit --output-on-failure -j "$jobs")
  ./scripts/build.sh --tsan --cpu-only --target strata_unit_tests
  echo "== TSan build: unit tests"
  (cd build-tsan-cpu && TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/../tests/tsan_suppressions.txt" \
     ctest -L unit --output-on-failure -j "$jobs")
fi
./scripts/build.sh
echo "== default build: all tests ($((SECONDS - start)) s so far)"
log="$(mktemp)"
set +e
(cd build && ctest --output-on-failure -j "$jobs") 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if grep -q '\*\*\*Skipped' "$log"; then
  echo "== why tests were skipped"
  (cd build && ctest -V -L gpu 2>&1) | grep -oE 'skipped, no GPU: .*' | sort | uniq -c || true
fi
echo "== $((SECONDS - start)) s in all"
grep -E '^[0-9]+% tests passed' "$log" | tail -n 1
rm -f "$log"
exit "$rc"
