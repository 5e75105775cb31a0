// What the CPU this process runs on can do, read once with CPUID/XGETBV (x86-64) for runtime
// dispatch between SIMD implementations. Vector features count only when the OS saves their
// registers (XSAVE state enabled), so "avx2" means usable, not merely present.
#pragma once

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

// The environment variable STRATA_ISA=avx2 (or =portable) hides the features above it, so that a
// benchmark can measure the slower kernels on a machine that has more.

// Detected on first use; thread-safe.
const CpuFeatures& GetCpuFeatures();

}  // namespace strata
