// CRC-32C throughput, hardware-dispatched vs the portable table path, against memcpy of the same
// bytes measured in the same run.
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/crc32c.h"

namespace strata {
namespace {

void BM_Crc32c(benchmark::State& state) {
  std::vector<uint8_t> buf(state.range(0), 0x5a);
  for (auto _ : state) benchmark::DoNotOptimize(Crc32c(buf.data(), buf.size()));
  state.SetBytesProcessed(state.iterations() * buf.size());
  state.SetLabel(Crc32cIsHardwareAccelerated() ? "sse4.2" : "portable");
}

void BM_Crc32cPortable(benchmark::State& state) {
  std::vector<uint8_t> buf(state.range(0), 0x5a);
  for (auto _ : state) benchmark::DoNotOptimize(Crc32cExtendPortable(0, buf.data(), buf.size()));
  state.SetBytesProcessed(state.iterations() * buf.size());
}

void BM_Memcpy(benchmark::State& state) {
  std::vector<uint8_t> src(state.range(0), 0x5a), dst(state.range(0));
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * src.size());
}

BENCHMARK(BM_Crc32c)->Arg(4 << 10)->Arg(256 << 10)->Arg(4 << 20);
BENCHMARK(BM_Crc32cPortable)->Arg(4 << 10)->Arg(256 << 10)->Arg(4 << 20);
BENCHMARK(BM_Memcpy)->Arg(4 << 10)->Arg(256 << 10)->Arg(4 << 20);

}  // namespace
}  // namespace strata
