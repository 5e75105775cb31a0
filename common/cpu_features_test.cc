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

// The cap is named by text and hides what it names; native again shows everything.
TEST(CpuFeaturesTest, ACapHidesTheFeaturesAboveIt) {
  IsaCap cap = IsaCap::kPortable;
  ASSERT_TRUE(ParseIsaCap("native", &cap));
  EXPECT_EQ(cap, IsaCap::kNative);
  ASSERT_TRUE(ParseIsaCap("avx2", &cap));
  EXPECT_EQ(cap, IsaCap::kAvx2);
  ASSERT_TRUE(ParseIsaCap("portable", &cap));
  EXPECT_EQ(cap, IsaCap::kPortable);
  for (const char* bad : {"", "AVX2", "avx512", "sse"}) EXPECT_FALSE(ParseIsaCap(bad, &cap)) << bad;
  const CpuFeatures native = GetCpuFeatures();
  CapCpuFeatures(IsaCap::kAvx2);
  const CpuFeatures avx2 = GetCpuFeatures();
  CapCpuFeatures(IsaCap::kPortable);
  const CpuFeatures portable = GetCpuFeatures();
  CapCpuFeatures(IsaCap::kNative);
  EXPECT_EQ(CpuFeaturesCap(), IsaCap::kNative);
  EXPECT_EQ(GetCpuFeatures().avx512f, native.avx512f);
  EXPECT_EQ(avx2.avx2, native.avx2);
  EXPECT_EQ(avx2.bmi2, native.bmi2);
  EXPECT_FALSE(avx2.avx512f || avx2.avx512vnni || avx2.avx_vnni);
  EXPECT_FALSE(portable.avx || portable.avx2 || portable.fma || portable.f16c || portable.bmi2);
  EXPECT_EQ(portable.sse42, native.sse42);
}

}  // namespace
}  // namespace strata
