// What a ParallelFor call costs beyond its tasks: calls of 8 tasks, each a busy wait of a fixed
// time, back to back on a pool of 2 threads (as decode calls attention and matmuls, several per
// layer). The counter overhead_us is the time per call less the 4 task-times each thread runs.
#include <chrono>

#include "benchmark/benchmark.h"
#include "common/thread_pool.h"

namespace strata {
namespace {

using Micros = std::chrono::duration<double, std::micro>;

void Busy(Micros d) {
  const auto end = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < end) {
  }
}

void BM_ParallelForOverhead(benchmark::State& state) {
  ThreadPool pool(2);
  const Micros task(static_cast<double>(state.range(0)));
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) pool.ParallelFor(8, [&](size_t) { Busy(task); });
  const Micros elapsed = std::chrono::steady_clock::now() - t0;
  if (state.iterations() > 0) {
    state.counters["overhead_us"] = elapsed.count() / state.iterations() - 4 * task.count();
  }
}
BENCHMARK(BM_ParallelForOverhead)->Arg(5)->Arg(40)->Arg(100)->UseRealTime();

}  // namespace
}  // namespace strata
