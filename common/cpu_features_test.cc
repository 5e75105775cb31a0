#include "common/cpu_features.h"

#include "gtest/gtest.h"

namespace strata {
namespace {

// The compiler's own detection (libgcc's, independent of ours) must agree where it has names.
TEST(CpuFeaturesTest, AgreesWithTheCompilerRuntime) {
  const CpuFeatures& f = GetCpuFeatures();
  __builtin_cpu_init();
  EXPECT_EQ(f.sse42, static_cast<bool>(__builtin_cpu_supports("sse4.2")));
  EXPECT_EQ(f.avx, static_cast<bool>(__builtin_cpu_supports("avx")));
  EXPECT_EQ(f.avx2, static_cast<bool>(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(f.fma, static_cast<bool>(__builtin_cpu_supports("fma")));
  EXPECT_EQ(f.avx512f, static_cast<bool>(__builtin_cpu_supports("avx512f")));
  EXPECT_EQ(f.avx512bw, static_cast<bool>(__builtin_cpu_supports("avx512bw")));
  // Implications that hold on every real CPU.
  EXPECT_TRUE(!f.avx2 || f.avx);
  EXPECT_TRUE(!f.avx512bw || f.avx512f);
  EXPECT_TRUE(!f.f16c || f.avx);
  EXPECT_TRUE(!f.fast_pext || f.bmi2);
  // pdep / pext are microcoded on Zen 1 and 2, in hardware from Zen 3 on.
  if (__builtin_cpu_is("znver1") || __builtin_cpu_is("znver2")) {
    EXPECT_FALSE(f.fast_pext);
  }
  if (__builtin_cpu_is("znver3")) {
    EXPECT_EQ(f.fast_pext, f.bmi2);
  }
}

}  // namespace
}  // namespace strata
