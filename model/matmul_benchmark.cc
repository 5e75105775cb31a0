// The model's products at an 8B's shapes: the row-invariant kernel (decode steps) against
// OpenBLAS in the same run, both on one thread. Items are multiply-adds.
#include <cblas.h>

#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "model/matmul.h"

namespace strata::model {
namespace {

struct Operands {
  std::vector<float> x, w, y;
  Operands(int rows, int in, int out)
      : x(size_t(rows) * in), w(size_t(out) * in), y(size_t(rows) * out) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0, 1);
    for (float& v : x) v = normal(rng);
    for (float& v : w) v = normal(rng);
  }
};

void BM_RowInvariant(benchmark::State& state) {
  const int rows = state.range(0), in = state.range(1), out = state.range(2);
  Operands o(rows, in, out);
  ThreadPool pool(1);
  for (auto _ : state) {
    MatMulRowInvariant(o.x.data(), rows, in, o.w.data(), out, o.y.data(), pool);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * rows * int64_t{in} * out);
}

void BM_OpenBlas(benchmark::State& state) {
  const int rows = state.range(0), in = state.range(1), out = state.range(2);
  Operands o(rows, in, out);
  openblas_set_num_threads(1);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.0f, o.x.data(), in,
                o.w.data(), in, 0.0f, o.y.data(), out);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * rows * int64_t{in} * out);
}

// rows x in x out: q/o projections (4096 x 4096), the MLP's down projection (14336 -> 4096).
void Shapes(benchmark::internal::Benchmark* b) {
  for (int rows : {1, 8, 32, 64}) b->Args({rows, 4096, 4096});
  b->Args({32, 14336, 4096});
  b->Args({32, 4096, 14336});
}
BENCHMARK(BM_RowInvariant)->Apply(Shapes)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_OpenBlas)->Apply(Shapes)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata::model
