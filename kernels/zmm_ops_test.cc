// The 512-bit operations of internal/zmm_ops.h: zmm_emulated (two AVX2 registers) gives, for
// every operation the zmm kernels use, the bytes of SIMDe's emulation of the AVX-512
// instruction (SIMD Everywhere, written and tested apart from this code), and zmm_native the
// same where the CPU has AVX-512. The attention kernels built on them are compared with the
// 256-bit ones in decode_attention_test.

// GCC 12 warns that the AVX-512 intrinsics' "undefined" operands (a register left as it is) may
// be used uninitialized once inlined (GCC bug 105593, fixed in 13); they are not values here.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// Clang warns that SIMDe's 512-bit vectors, passed between this file's functions (none of them
// compiled for AVX-512), would change the ABI of a call to a function compiled for it; none is.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#endif
#include "kernels/internal/zmm_ops.h"

#include <gtest/gtest.h>
#include <simde/x86/avx512.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/cpu_features.h"

namespace strata::kernels::internal {
namespace {

using Bytes = std::array<uint8_t, 64>;

// Each operation of the kernels on (a, b, c): its result's bytes (64 for a register; 32 or 16
// for a narrower result, the rest zero).
enum class Op {
  kAdd32,
  kAnd,
  kSrli16By2,
  kSrli16By6,
  kSlli32By8,
  kDpbusd,
  kDpwssd,
  kUnpackLo32,
  kUnpackHi32,
  kUnpackLo64,
  kUnpackHi64,
  kSwapAdjacentQuarters,
  kSwapHalves,
  kQuarter0,
  kQuarter1,
  kQuarter2,
  kQuarter3,
  kWidenBytes,
  kPairLaneSums,
  kSet1Epi8,
  kSet1Epi64,
  kLast = kSet1Epi64,
};

// One implementation of every Op on the namespace's Zi (zmm_native or zmm_emulated).
#define STRATA_ZMM_OPS_BODY                                                                \
  const Zi a = Load(in_a.data()), b = Load(in_b.data()), c = Load(in_c.data());            \
  Zi r = Zero();                                                                           \
  __m128i q = _mm_setzero_si128();                                                         \
  __m256i s = _mm256_setzero_si256();                                                      \
  const void* src = &r;                                                                    \
  size_t n = 64;                                                                           \
  switch (op) {                                                                            \
    case Op::kAdd32:                                                                       \
      r = Add32(a, b);                                                                     \
      break;                                                                               \
    case Op::kAnd:                                                                         \
      r = And(a, b);                                                                       \
      break;                                                                               \
    case Op::kSrli16By2:                                                                   \
      r = Srli16<2>(a);                                                                    \
      break;                                                                               \
    case Op::kSrli16By6:                                                                   \
      r = Srli16<6>(a);                                                                    \
      break;                                                                               \
    case Op::kSlli32By8:                                                                   \
      r = Slli32<8>(a);                                                                    \
      break;                                                                               \
    case Op::kDpbusd:                                                                      \
      r = Dpbusd(c, a, b);                                                                 \
      break;                                                                               \
    case Op::kDpwssd:                                                                      \
      r = Dpwssd(c, a, b);                                                                 \
      break;                                                                               \
    case Op::kUnpackLo32:                                                                  \
      r = UnpackLo32(a, b);                                                                \
      break;                                                                               \
    case Op::kUnpackHi32:                                                                  \
      r = UnpackHi32(a, b);                                                                \
      break;                                                                               \
    case Op::kUnpackLo64:                                                                  \
      r = UnpackLo64(a, b);                                                                \
      break;                                                                               \
    case Op::kUnpackHi64:                                                                  \
      r = UnpackHi64(a, b);                                                                \
      break;                                                                               \
    case Op::kSwapAdjacentQuarters:                                                        \
      r = SwapAdjacentQuarters(a);                                                         \
      break;                                                                               \
    case Op::kSwapHalves:                                                                  \
      r = SwapHalves(a);                                                                   \
      break;                                                                               \
    case Op::kQuarter0:                                                                    \
    case Op::kQuarter1:                                                                    \
    case Op::kQuarter2:                                                                    \
    case Op::kQuarter3:                                                                    \
      q = Quarter(a, static_cast<uint32_t>(op) - static_cast<uint32_t>(Op::kQuarter0));    \
      src = &q;                                                                            \
      n = 16;                                                                              \
      break;                                                                               \
    case Op::kWidenBytes:                                                                  \
      r = WidenBytes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in_a.data())),       \
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(in_a.data() + 16))); \
      break;                                                                               \
    case Op::kPairLaneSums:                                                                \
      s = PairLaneSums(a);                                                                 \
      src = &s;                                                                            \
      n = 32;                                                                              \
      break;                                                                               \
    case Op::kSet1Epi8:                                                                    \
      r = Set1Epi8(static_cast<char>(in_a[0]));                                            \
      break;                                                                               \
    case Op::kSet1Epi64: {                                                                 \
      int64_t x;                                                                           \
      std::memcpy(&x, in_a.data(), 8);                                                     \
      r = Set1Epi64(x);                                                                    \
      break;                                                                               \
    }                                                                                      \
  }                                                                                        \
  Bytes out{};                                                                             \
  std::memcpy(out.data(), src, n);                                                         \
  return out;

__attribute__((target("avx2,fma,f16c"))) Bytes Emulated(Op op, const Bytes& in_a, const Bytes& in_b,
                                                        const Bytes& in_c) {
  using namespace zmm_emulated;
  STRATA_ZMM_OPS_BODY
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))) Bytes Native(
    Op op, const Bytes& in_a, const Bytes& in_b, const Bytes& in_c) {
  using namespace zmm_native;
  STRATA_ZMM_OPS_BODY
}
#undef STRATA_ZMM_OPS_BODY

// SIMDe's AVX-512 (portable code here: no AVX-512 in this function's target).
Bytes Simde(Op op, const Bytes& in_a, const Bytes& in_b, const Bytes& in_c) {
  const simde__m512i a = simde_mm512_loadu_si512(in_a.data());
  const simde__m512i b = simde_mm512_loadu_si512(in_b.data());
  const simde__m512i c = simde_mm512_loadu_si512(in_c.data());
  Bytes out{};
  auto put = [&](simde__m512i x) { simde_mm512_storeu_si512(out.data(), x); };
  switch (op) {
    case Op::kAdd32:
      put(simde_mm512_add_epi32(a, b));
      break;
    case Op::kAnd:
      put(simde_mm512_and_si512(a, b));
      break;
    case Op::kSrli16By2:
      put(simde_mm512_srli_epi16(a, 2));
      break;
    case Op::kSrli16By6:
      put(simde_mm512_srli_epi16(a, 6));
      break;
    case Op::kSlli32By8:
      put(simde_mm512_slli_epi32(a, 8));
      break;
    case Op::kDpbusd:
      put(simde_mm512_dpbusd_epi32(c, a, b));
      break;
    case Op::kDpwssd:
      put(simde_mm512_dpwssd_epi32(c, a, b));
      break;
    case Op::kUnpackLo32:
      put(simde_mm512_unpacklo_epi32(a, b));
      break;
    case Op::kUnpackHi32:
      put(simde_mm512_unpackhi_epi32(a, b));
      break;
    case Op::kUnpackLo64:
      put(simde_mm512_unpacklo_epi64(a, b));
      break;
    case Op::kUnpackHi64:
      put(simde_mm512_unpackhi_epi64(a, b));
      break;
    case Op::kSwapAdjacentQuarters:
      put(simde_mm512_shuffle_i32x4(a, a, 0xb1));
      break;
    case Op::kSwapHalves:
      put(simde_mm512_shuffle_i32x4(a, a, 0x4e));
      break;
    case Op::kQuarter0:
      simde_mm_storeu_si128(out.data(), simde_mm512_extracti32x4_epi32(a, 0));
      break;
    case Op::kQuarter1:
      simde_mm_storeu_si128(out.data(), simde_mm512_extracti32x4_epi32(a, 1));
      break;
    case Op::kQuarter2:
      simde_mm_storeu_si128(out.data(), simde_mm512_extracti32x4_epi32(a, 2));
      break;
    case Op::kQuarter3:
      simde_mm_storeu_si128(out.data(), simde_mm512_extracti32x4_epi32(a, 3));
      break;
    case Op::kWidenBytes:
      put(simde_mm512_cvtepi8_epi16(simde_mm256_loadu_si256(in_a.data())));
      break;
    case Op::kPairLaneSums:
      // The native one's sequence: lane 2m + lane 2m + 1 in the low half of each int64 lane.
      simde_mm256_storeu_si256(out.data(), simde_mm512_cvtepi64_epi32(simde_mm512_add_epi32(
                                               a, simde_mm512_srli_epi64(a, 32))));
      break;
    case Op::kSet1Epi8:
      put(simde_mm512_set1_epi8(static_cast<char>(in_a[0])));
      break;
    case Op::kSet1Epi64: {
      int64_t x;
      std::memcpy(&x, in_a.data(), 8);
      put(simde_mm512_set1_epi64(x));
      break;
    }
  }
  return out;
}

std::string Hex(const Bytes& b) {
  std::string s;
  char buf[4];
  for (size_t i = 0; i < b.size(); ++i) {
    std::snprintf(buf, sizeof(buf), "%02x%s", b[i], i % 4 == 3 ? " " : "");
    s += buf;
  }
  return s;
}

TEST(ZmmOpsTest, EmulatedOpsAreSimdesAndTheInstructions) {
  const CpuFeatures& f = GetCpuFeatures();
  if (!f.avx2 || !f.fma || !f.f16c) GTEST_SKIP() << "no AVX2: the zmm kernels never run here";
  const bool native = f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni;
  std::printf("emulated 512-bit operations compared with SIMDe%s\n",
              native ? " and with AVX-512" : " (no AVX512-VNNI here)");
  std::mt19937_64 rng(77);
  // Random bytes, then the extremes: vpdpbusd's largest products (255 * -128), and vpdpwssd's
  // operands at -32768 and 32767 (b halved below).
  std::vector<std::array<Bytes, 3>> inputs;
  for (int i = 0; i < 200; ++i) {
    std::array<Bytes, 3> in;
    for (Bytes& b : in) {
      for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
    }
    inputs.push_back(in);
  }
  std::array<Bytes, 3> extreme;
  extreme[0].fill(0xff);
  extreme[1].fill(0x80);
  extreme[2].fill(0x00);
  inputs.push_back(extreme);
  for (size_t i = 0; i < 64; i += 2) {
    extreme[0][i] = extreme[1][i] = 0x00;
    extreme[0][i + 1] = 0x80;                      // int16 -32768
    extreme[1][i + 1] = i % 4 == 0 ? 0x80 : 0x7f;  // -32768, or 32767 (0x7f00)
  }
  inputs.push_back(extreme);
  // The sums of the dot products stay inside int32 (as the kernels' do by their bounds): SIMDe's
  // portable code adds in signed int32, where a wrap is undefined behaviour (UBSan stops), while
  // the instructions wrap. So the accumulator's lanes are kept within +-2^23 and, for vpdpwssd,
  // whose two products can reach 2^31 in all, the second operand's int16s are halved.
  auto bounded = [](Op op, std::array<Bytes, 3> in) {
    if (op != Op::kDpbusd && op != Op::kDpwssd) return in;
    for (size_t i = 0; i < 64; i += 4) in[2][i + 3] = in[2][i + 2] & 0x80 ? 0xff : 0x00;
    if (op == Op::kDpwssd) {  // |a * b| <= 2^15 * 2^14
      for (size_t i = 0; i < 64; i += 2) {
        int16_t x;
        std::memcpy(&x, &in[1][i], 2);
        x = static_cast<int16_t>(x / 2);
        std::memcpy(&in[1][i], &x, 2);
      }
    }
    return in;
  };
  for (int o = 0; o <= static_cast<int>(Op::kLast); ++o) {
    const Op op = static_cast<Op>(o);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto [a, b, c] = bounded(op, inputs[i]);
      const Bytes want = Simde(op, a, b, c);
      EXPECT_EQ(Hex(Emulated(op, a, b, c)), Hex(want)) << "op " << o << " input " << i;
      if (native) {
        EXPECT_EQ(Hex(Native(op, a, b, c)), Hex(want)) << "op " << o << " input " << i;
      }
    }
  }
}

}  // namespace
}  // namespace strata::kernels::internal
