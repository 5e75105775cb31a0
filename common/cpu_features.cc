#include "common/cpu_features.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace strata {
namespace {

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.sse42 = (c >> 20) & 1;
  const bool osxsave = (c >> 27) & 1;
  uint64_t xcr0 = 0;
  if (osxsave) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t{hi} << 32) | lo;
  }
  const bool ymm_saved = (xcr0 & 0x6) == 0x6;                 // SSE and AVX state
  const bool zmm_saved = ymm_saved && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  f.avx = ymm_saved && ((c >> 28) & 1);
  f.f16c = f.avx && ((c >> 29) & 1);
  f.fma = f.avx && ((c >> 12) & 1);
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = f.avx && ((b >> 5) & 1);
    f.avx512f = zmm_saved && ((b >> 16) & 1);
    f.avx512bw = f.avx512f && ((b >> 30) & 1);
    f.avx512vl = f.avx512f && ((b >> 31) & 1);
    f.avx512vnni = f.avx512f && ((c >> 11) & 1);
    f.bmi2 = (b >> 8) & 1;
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx_vnni = f.avx2 && ((a >> 4) & 1);
  f.fast_pext = f.bmi2;
  // AMD ("Auth"enticAMD) and Hygon ("Hygo"nGenuine, Zen 1 based) before family 0x19.
  if (__get_cpuid(0, &a, &b, &c, &d) && (b == 0x68747541u || b == 0x6f677948u)) {
    __get_cpuid(1, &a, &b, &c, &d);
    const unsigned family = ((a >> 8) & 0xf) + (((a >> 8) & 0xf) == 0xf ? (a >> 20) & 0xff : 0);
    if (family < 0x19) f.fast_pext = false;
  }
#endif
  // STRATA_ISA caps what the kernels may use, to measure a slower path on a faster machine:
  // "portable" (none of these), "avx2" (AVX2+FMA+F16C, no VNNI, no AVX-512).
  if (const char* cap = std::getenv("STRATA_ISA"); cap != nullptr) {
    const std::string_view v(cap);
    if (v == "portable" || v == "avx2") {
      f.avx512f = f.avx512bw = f.avx512vl = f.avx512vnni = f.avx_vnni = false;
      if (v == "portable") f.bmi2 = f.fast_pext = false;
    }
    if (v == "portable") f.avx = f.avx2 = f.fma = f.f16c = false;
    if (v != "portable" && v != "avx2" && !v.empty()) {
      std::fprintf(stderr, "STRATA_ISA=%s ignored (portable or avx2)\n", cap);
    }
  }
  return f;
}

}  // namespace

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

}  // namespace strata
