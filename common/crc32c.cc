#include "common/crc32c.h"

#include <nmmintrin.h>

#include <array>
#include <cstring>

#include "common/cpu_features.h"

namespace strata {
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

using ByteTables = std::array<std::array<uint32_t, 256>, 8>;

constexpr ByteTables MakeSlicingTables() {
  ByteTables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
    t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
  }
  return t;
}

constexpr ByteTables kTables = MakeSlicingTables();

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));  // little-endian host (x86-64)
  return v;
}

// Raw register update (no pre/post inversion).
uint32_t UpdatePortable(uint32_t c, const uint8_t* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    const uint64_t v = Load64(p) ^ c;
    c = kTables[7][v & 0xff] ^ kTables[6][(v >> 8) & 0xff] ^ kTables[5][(v >> 16) & 0xff] ^
        kTables[4][(v >> 24) & 0xff] ^ kTables[3][(v >> 32) & 0xff] ^ kTables[2][(v >> 40) & 0xff] ^
        kTables[1][(v >> 48) & 0xff] ^ kTables[0][v >> 56];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ kTables[0][(c ^ *p) & 0xffu];
  return c;
}

// The linear map "feed `len` zero bytes into the raw register", applied bytewise by four
// 256-entry tables. Built once from the images of the 32 basis states.
struct ZeroShift {
  std::array<std::array<uint32_t, 256>, 4> t{};
  explicit ZeroShift(size_t len) {
    static const uint8_t kZeros[1024] = {};
    std::array<uint32_t, 32> column{};
    for (int bit = 0; bit < 32; ++bit) {
      uint32_t c = 1u << bit;
      for (size_t left = len; left > 0;) {
        const size_t step = left < sizeof(kZeros) ? left : sizeof(kZeros);
        c = UpdatePortable(c, kZeros, step);
        left -= step;
      }
      column[bit] = c;
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int i = 0; i < 8; ++i) {
          if (b & (1u << i)) v ^= column[8 * k + i];
        }
        t[k][b] = v;
      }
    }
  }
  uint32_t Apply(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

constexpr size_t kLong = 8192;  // bytes per stream in the large interleaved loop
constexpr size_t kShort = 256;  // bytes per stream in the small interleaved loop

// Consumes 3 * stream bytes at a time as three independent streams, which keeps the crc32 unit
// busy (latency 3, throughput 1 per cycle), then joins them with the zero-shift operator.
__attribute__((target("sse4.2"))) uint32_t UpdateInterleaved(uint32_t c, const uint8_t*& p,
                                                             size_t& n, size_t stream,
                                                             const ZeroShift& shift) {
  while (n >= 3 * stream) {
    uint64_t c0 = c, c1 = 0, c2 = 0;
    const uint8_t* end = p + stream;
    for (; p < end; p += 8) {
      c0 = _mm_crc32_u64(c0, Load64(p));
      c1 = _mm_crc32_u64(c1, Load64(p + stream));
      c2 = _mm_crc32_u64(c2, Load64(p + 2 * stream));
    }
    c = shift.Apply(shift.Apply(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1)) ^
        static_cast<uint32_t>(c2);
    p += 2 * stream;
    n -= 3 * stream;
  }
  return c;
}

__attribute__((target("sse4.2"))) uint32_t UpdateHardware(uint32_t c, const uint8_t* p, size_t n) {
  static const ZeroShift kShiftLong(kLong);
  static const ZeroShift kShiftShort(kShort);
  c = UpdateInterleaved(c, p, n, kLong, kShiftLong);
  c = UpdateInterleaved(c, p, n, kShort, kShiftShort);
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) c64 = _mm_crc32_u64(c64, Load64(p));
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}

const bool kHaveSse42 = GetCpuFeatures().sse42;

// GF(2) 32x32 matrices as 32 columns; used by Crc32cCombine.
using Matrix = std::array<uint32_t, 32>;

uint32_t Times(const Matrix& m, uint32_t v) {
  uint32_t r = 0;
  for (int i = 0; v != 0; ++i, v >>= 1) {
    if (v & 1u) r ^= m[i];
  }
  return r;
}

Matrix Square(const Matrix& m) {
  Matrix r{};
  for (int i = 0; i < 32; ++i) r[i] = Times(m, m[i]);
  return r;
}

}  // namespace

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n) {
  return ~UpdatePortable(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  return ~(kHaveSse42 ? UpdateHardware(~crc, p, n) : UpdatePortable(~crc, p, n));
}

uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

bool Crc32cIsHardwareAccelerated() { return kHaveSse42; }

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, size_t len_b) {
  // crc(A||B) = shift(crc(A), len_b) ^ crc(B) in raw-register terms; the inversions of the
  // standard CRC cancel except for the shift of the ~0 seed, which shift(crc_a) accounts for.
  // Walk len_b in binary with the operator for one zero bit doubled by squaring each step.
  Matrix op{};  // one zero *byte*: built from the single-bit operator squared three times
  op[0] = kPoly;
  for (int i = 1; i < 32; ++i) op[i] = 1u << (i - 1);
  op = Square(Square(Square(op)));
  uint32_t c = crc_a;
  for (size_t len = len_b; len != 0; len >>= 1) {
    if (len & 1u) c = Times(op, c);
    op = Square(op);
  }
  return c ^ crc_b;
}

}  // namespace strata
