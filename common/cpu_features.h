// What the CPU this process runs on can do, read once with CPUID/XGETBV (x86-64) for runtime
// dispatch between SIMD implementations. Vector features count only when the OS saves their
// registers (XSAVE state enabled), so "avx2" means usable, not merely present.
#pragma once

#include <string_view>

namespace strata {

struct CpuFeatures {
  bool sse42 = false;
  bool avx = false;
  bool f16c = false;
  bool fma = false;
  bool avx2 = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;  // vpdpbusd on EVEX (with avx512vl: on 256-bit registers too)
  bool avx_vnni = false;    // vpdpbusd on VEX (AVX-VNNI)
  bool bmi2 = false;        // pdep / pext
  bool fast_pext = false;   // bmi2, and pdep / pext in hardware (AMD before Zen 3, family 0x19,
                            // microcodes them at hundreds of cycles each)
};

// Detected once (on first use), with the cap below applied; thread-safe.
CpuFeatures GetCpuFeatures();

// Hiding features the CPU has, so that a benchmark measures (codec_bench --isa) or a test runs
// (kernels_test --strata_isa) the slower kernels on a machine that has faster ones:
//   kNative: nothing hidden;
//   kAvx2: AVX2 + FMA + F16C + BMI2, no VNNI, no AVX-512;
//   kPortable: none of the vector features or BMI2.
enum class IsaCap { kNative, kAvx2, kPortable };
// "native", "avx2" or "portable"; false for anything else.
bool ParseIsaCap(std::string_view text, IsaCap* cap);
// Caps what GetCpuFeatures reports from now on. Call at start (a process's flags), before any
// kernel runs: the kernels read the features once, at their first use. (The fp16 conversions and
// CRC-32C read theirs before main; they give the same bits either way.)
void CapCpuFeatures(IsaCap cap);
// The cap in effect (kNative unless CapCpuFeatures set another).
IsaCap CpuFeaturesCap();

}  // namespace strata
