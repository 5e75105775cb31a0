// Encode throughput of one 256-token x 8-head x 128 chunk (fp16 input), per codec.
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/half.h"
#include "kernels/codec.h"
#include "kernels/codec_spec.h"
#include "kernels/synthetic_kv.h"

namespace strata::kernels {
namespace {

void BM_Encode(benchmark::State& state, const char* spec) {
  const SyntheticKv kv = MakeSyntheticKv(256, 8, 128, 1);
  std::vector<Half> k(kv.k.size()), v(kv.v.size());
  FloatToHalf(kv.k.data(), k.data(), k.size());
  FloatToHalf(kv.v.data(), v.data(), v.size());
  // SKVQ takes a calibration: a stand-in one (random channel orders, clipping).
  auto codec =
      *Codec::Create(spec, std::string(spec).starts_with("skvq")
                               ? MakeSyntheticCalibration(*CodecSpec::Parse(spec), 8, 128, 1)
                               : nullptr);
  KvChunkView view{k.data(), v.data(), SourceDType::kFloat16, 256, 8, 128};
  // ZipCache takes the tokens' queries (32 heads) for its probe attention.
  std::vector<float> q;
  if (std::string(spec).starts_with("zipcache")) {
    const SyntheticKv qs = MakeSyntheticKv(256, 32, 128, 2);
    q = qs.k;
    view.q = q.data();
    view.q_heads = 32;
  }
  for (auto _ : state) {
    auto block = codec->Encode(view, {});
    benchmark::DoNotOptimize(block);
  }
  state.SetBytesProcessed(state.iterations() * (k.size() + v.size()) * sizeof(Half));
}

BENCHMARK_CAPTURE(BM_Encode, fp16, "fp16");
BENCHMARK_CAPTURE(BM_Encode, int8, "int8");
BENCHMARK_CAPTURE(BM_Encode, fp8, "fp8e4m3");
BENCHMARK_CAPTURE(BM_Encode, kivi2, "kivi:k2v2:g32");
BENCHMARK_CAPTURE(BM_Encode, kivi3, "kivi:k3v3:g32");
BENCHMARK_CAPTURE(BM_Encode, kivi2_m8, "kivi:k2v2:g32:m8");
BENCHMARK_CAPTURE(BM_Encode, kcvt2, "kcvt:k2v2");
BENCHMARK_CAPTURE(BM_Encode, skvq2, "skvq:k2v2:g32");
BENCHMARK_CAPTURE(BM_Encode, skvq2_m8, "skvq:k2v2:g64:m8");
BENCHMARK_CAPTURE(BM_Encode, tada2, "tada:k2v2:g32");
BENCHMARK_CAPTURE(BM_Encode, gearl2, "gearl:k2v2:g32:r4");
BENCHMARK_CAPTURE(BM_Encode, gear2, "gear:k2v2:g32:r4:s2");
BENCHMARK_CAPTURE(BM_Encode, zipcache2, "zipcache:k2v2:h4:s10");

}  // namespace
}  // namespace strata::kernels
