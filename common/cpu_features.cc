#include "common/cpu_features.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <atomic>
#include <cstdint>
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
  return f;
}

std::atomic<int> isa_cap{static_cast<int>(IsaCap::kNative)};

CpuFeatures Capped(CpuFeatures f, IsaCap cap) {
  if (cap == IsaCap::kNative) return f;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512vnni = f.avx_vnni = false;
  if (cap == IsaCap::kPortable) f.avx = f.avx2 = f.fma = f.f16c = f.bmi2 = f.fast_pext = false;
  return f;
}

}  // namespace

CpuFeatures GetCpuFeatures() {
  static const CpuFeatures detected = Detect();
  return Capped(detected, CpuFeaturesCap());
}

bool ParseIsaCap(std::string_view text, IsaCap* cap) {
  if (text == "native") {
    *cap = IsaCap::kNative;
  } else if (text == "avx2") {
    *cap = IsaCap::kAvx2;
  } else if (text == "portable") {
    *cap = IsaCap::kPortable;
  } else {
    return false;
  }
  return true;
}

IsaCap CpuFeaturesCap() { return static_cast<IsaCap>(isa_cap.load()); }

void CapCpuFeatures(IsaCap cap) { isa_cap.store(static_cast<int>(cap)); }

}  // namespace strata
