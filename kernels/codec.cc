#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_writer.h"
#include "common/fp8.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/bit_pack.h"
#include "kernels/codebook.h"
#include "kernels/codec_layout.h"
#include "kernels/internal/codec_simd.h"
#include "kernels/internal/vector_exp.h"
#include "kernels/low_rank.h"

namespace strata::kernels {
namespace {

// Largest magnitude the fp16 metadata can carry with headroom for rounding.
constexpr float kMetadataLimit = 60000.0f;

// Freed scratch blocks kept per thread for the next chunk. A chunk's scratch is megabytes, and
// glibc hands blocks that large back to the kernel on free (mmap above 128 KiB, or a trimmed heap
// top), so without this every chunk paid its page faults again: 40 % of GEAR's encode time in
// kernels_benchmark. At most kMaxBlocks blocks and kMaxBytes per thread are kept.
class ScratchCache {
 public:
  ~ScratchCache() {
    for (const Block& b : blocks_) ::operator delete(b.p);
  }
  // A block of at least `bytes`; its real size in *size.
  void* Get(size_t bytes, size_t* size) {
    int best = -1;
    for (int i = 0; i < static_cast<int>(blocks_.size()); ++i) {
      if (blocks_[i].size >= bytes && (best < 0 || blocks_[i].size < blocks_[best].size)) best = i;
    }
    if (best < 0) {
      *size = bytes;
      return ::operator new(bytes);
    }
    const Block b = blocks_[best];
    blocks_.erase(blocks_.begin() + best);
    cached_ -= b.size;
    *size = b.size;
    return b.p;
  }
  void Put(void* p, size_t size) {
    if (size > kMaxBytes) {
      ::operator delete(p);
      return;
    }
    // Make room by dropping the smallest blocks (the large ones are the costly ones to fault).
    while (!blocks_.empty() && (blocks_.size() >= kMaxBlocks || cached_ + size > kMaxBytes)) {
      auto smallest =
          std::min_element(blocks_.begin(), blocks_.end(),
                           [](const Block& a, const Block& b) { return a.size < b.size; });
      if (smallest->size > size) {  // the new block is the smallest: drop it instead
        ::operator delete(p);
        return;
      }
      cached_ -= smallest->size;
      ::operator delete(smallest->p);
      blocks_.erase(smallest);
    }
    blocks_.push_back({p, size});
    cached_ += size;
  }
  static ScratchCache& ThisThread() {
    thread_local ScratchCache cache;
    return cache;
  }

 private:
  static constexpr size_t kMaxBlocks = 16;
  static constexpr size_t kMaxBytes = size_t{64} << 20;
  struct Block {
    void* p;
    size_t size;
  };
  std::vector<Block> blocks_;
  size_t cached_ = 0;
};

// An allocator whose resize leaves new elements uninitialized: the codecs' per-chunk scratch
// (a chunk's values, codes and residual, up to megabytes) is written whole before it is
// read, and zeroing it first cost a memory pass each. Blocks of 64 KiB and more come from and
// go back to the thread's ScratchCache (a header before the elements keeps the block's size).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  static constexpr size_t kCached = size_t{64} << 10;
  static constexpr size_t kHeader = 16;  // the elements stay aligned as operator new's
  static_assert(alignof(T) <= kHeader);
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kCached) return std::allocator<T>::allocate(n);
    size_t size = 0;
    auto* block = static_cast<char*>(ScratchCache::ThisThread().Get(bytes + kHeader, &size));
    std::memcpy(block, &size, sizeof(size));
    return reinterpret_cast<T*>(block + kHeader);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kCached) {
      std::allocator<T>::deallocate(p, n);
      return;
    }
    char* block = reinterpret_cast<char*>(p) - kHeader;
    size_t size;
    std::memcpy(&size, block, sizeof(size));
    ScratchCache::ThisThread().Put(block, size);
  }
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using Scratch = std::vector<T, DefaultInitAllocator<T>>;

// One tensor (K or V) in head-major fp32: x[(h * T + t) * D + d].
struct HeadMajor {
  uint32_t t = 0, h = 0, d = 0;
  Scratch<float> x;
  float& at(uint32_t head, uint32_t tok, uint32_t ch) {
    return x[(size_t{head} * t + tok) * d + ch];
  }
};

// Converts one row of `n` source values to float.
void SourceRow(const void* p, SourceDType dt, size_t offset, size_t n, float* out) {
  switch (dt) {
    case SourceDType::kFloat32:
      std::memcpy(out, static_cast<const float*>(p) + offset, n * sizeof(float));
      return;
    case SourceDType::kFloat16:
      HalfToFloat(static_cast<const Half*>(p) + offset, out, n);
      return;
    case SourceDType::kBFloat16:
      BFloat16ToFloat(static_cast<const BFloat16*>(p) + offset, out, n);
      return;
  }
}

// The chunk's `src` tensor head-major in float, every value checked against `limit`. With
// `perm` ([H][D], SKVQ's calibrated channel order), each row's channels are stored in that order
// (row[i] = channel perm[h * D + i]), eight tokens at a time while they are in cache.
absl::StatusOr<HeadMajor> ToHeadMajor(const KvChunkView& c, const void* src, const char* name,
                                      float limit, const uint16_t* perm = nullptr) {
  HeadMajor m;
  m.t = c.tokens;
  m.h = c.kv_heads;
  m.d = c.head_dim;
  m.x.resize(size_t{m.t} * m.h * m.d);
  const bool simd = internal::HaveCodecSimd();
  std::vector<float> row(perm != nullptr && !simd ? m.d : 0);
  constexpr uint32_t kBlock = 8;
  for (uint32_t tok0 = 0; tok0 < m.t; tok0 += kBlock) {
    const uint32_t tok1 = std::min(m.t, tok0 + kBlock);
    if (perm != nullptr && simd && c.dtype == SourceDType::kFloat16 && tok1 - tok0 == kBlock &&
        m.d % 8 == 0) {
      // Eight whole tokens of fp16 in SKVQ's order: widened, checked and permuted in one pass
      // per head. Any value out of range: the passes below, which name it.
      bool all = true;
      for (uint32_t head = 0; head < m.h && all; ++head) {
        all = internal::HalfToFloatPermutedWithinAvx2(
            static_cast<const uint16_t*>(src) + (size_t{tok0} * m.h + head) * m.d,
            size_t{m.h} * m.d, m.d, perm + size_t{head} * m.d, limit, &m.at(head, tok0, 0));
      }
      if (all) continue;
    }
    for (uint32_t tok = tok0; tok < tok1; ++tok) {
      for (uint32_t head = 0; head < m.h; ++head) {
        float* dst = &m.at(head, tok, 0);
        const size_t offset = (size_t{tok} * m.h + head) * m.d;
        bool ok = true;  // one branch-free pass; the slow path finds the culprit
        if (simd && c.dtype == SourceDType::kFloat16) {
          ok = internal::HalfToFloatWithinAvx2(static_cast<const uint16_t*>(src) + offset, m.d,
                                               limit, dst);
        } else if (simd) {
          SourceRow(src, c.dtype, offset, m.d, dst);
          ok = internal::AllWithinAvx2(dst, m.d, limit);
        } else {
          SourceRow(src, c.dtype, offset, m.d, dst);
          for (uint32_t ch = 0; ch < m.d; ++ch) ok &= std::fabs(dst[ch]) <= limit;
        }
        if (ok) continue;
        for (uint32_t ch = 0; ch < m.d; ++ch) {
          const float v = dst[ch];
          if (!std::isfinite(v) || std::fabs(v) > limit) {
            return absl::InvalidArgumentError(absl::StrCat(
                "codec: ", name, "[token ", tok, ", head ", head, ", channel ", ch, "] = ", v,
                std::isfinite(v) ? absl::StrCat(" exceeds this codec's range of +-", limit)
                                 : " is not finite"));
          }
        }
      }
    }
    if (perm == nullptr) continue;
    for (uint32_t head = 0; head < m.h; ++head) {
      const uint16_t* p = perm + size_t{head} * m.d;
      if (simd) {
        internal::PermuteRowsAvx2(&m.at(head, tok0, 0), tok1 - tok0, m.d, p);
        continue;
      }
      for (uint32_t tok = tok0; tok < tok1; ++tok) {
        float* x = &m.at(head, tok, 0);
        for (uint32_t d = 0; d < m.d; ++d) row[d] = x[p[d]];
        std::copy(row.begin(), row.end(), x);
      }
    }
  }
  return m;
}

uint16_t F16(float f) { return FloatToHalfBits(f); }

// max |x[i]| over [0, n), NaNs skipped (0 for none).
float MaxAbs(const float* x, size_t n) {
  if (internal::HaveCodecSimd()) return internal::MaxAbsAvx2(x, n, 0.0f);
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}
float F32(uint16_t h) { return HalfBitsToFloat(h); }

template <typename T>
void Put(BlockBuilder& b, int section, const std::vector<T>& v) {
  std::memcpy(b.section(section).data(), v.data(), b.section(section).size());
}

// ---- the affine family: KIVI, KCVT, GEAR, GEAR-L ----

struct AffineResult {
  std::vector<uint8_t> packed;
  std::vector<uint16_t> scales, zeros;   // fp16 bits
  std::vector<uint8_t> scales8, zeros8;  // fp8 e4m3, when asked for
  float multipliers[2] = {1.0f, 1.0f};   // of the fp8 scales and zero points
  Scratch<float> residual;  // x minus its dequantized backbone, head-major; empty unless asked for
};

// Quantizes x asymmetrically in groups; mask (may be empty) marks outliers left out of each
// group's min/max. K: groups of `gs` tokens per (head, channel); V: groups of `gs` channels per
// (head, token).
AffineResult QuantizeAffine(const HeadMajor& x, bool per_channel, uint32_t gs, uint32_t groups,
                            int bits, const std::vector<uint8_t>& mask, float clip = 1.0f,
                            bool fp8_meta = false, bool want_residual = true) {
  const uint32_t T = x.t, H = x.h, D = x.d;
  const float qmax = static_cast<float>((1 << bits) - 1);
  AffineResult r;
  Scratch<uint8_t> codes(x.x.size());  // every element is written below
  // The residual of each row is taken while its values are in cache: the dequantized backbone
  // (zero + code * scale), then x minus it.
  if (want_residual) r.residual.resize(x.x.size());
  float* residual = want_residual ? r.residual.data() : nullptr;
  const size_t n_params = per_channel ? size_t{H} * groups * D : size_t{H} * T * groups;
  r.scales.resize(n_params);
  r.zeros.resize(n_params);
  if (fp8_meta) {
    r.scales8.resize(n_params);
    r.zeros8.resize(n_params);
    // Multipliers from the tensor's largest magnitude: zero points lie within it, scales within
    // twice it over qmax (with headroom for the rounded-down zero).
    const float maxabs = std::max(MaxAbs(x.x.data(), x.x.size()), 1e-20f);
    r.multipliers[0] = 2.1f * maxabs / qmax / kFp8E4M3Max;
    r.multipliers[1] = maxabs / kFp8E4M3Max;
  }
  const bool masked = !mask.empty();
  // The AVX2 loops give the same bytes (kernels/internal/codec_simd.h).
  const bool simd = internal::HaveCodecSimd();
  std::vector<float> mn(D), mx(D), scale(D), zero(D), inv(D), glo, ghi, gs_scale, gs_zero, gs_inv;
  // Stores the fp16 parameters of one group and returns them as float (what decode sees).
  auto params = [&](float lo, float hi, size_t p, float* s_out, float* z_out, float* inv_out) {
    if (lo > hi) lo = hi = 0;  // every element of the group is an outlier
    if (fp8_meta) {            // zero rounded down, scale up: the group's range stays covered
      const float ms = r.multipliers[0], mz = r.multipliers[1];
      r.zeros8[p] = Fp8E4M3Floor(lo / mz);
      // What decode sees: fp8 x multiplier, widened to fp16.
      const float z = F32(F16(Fp8E4M3ToFloat(r.zeros8[p]) * mz));
      r.scales8[p] = Fp8E4M3Ceil((hi - z) / qmax / ms);
      *s_out = F32(F16(Fp8E4M3ToFloat(r.scales8[p]) * ms));
      *z_out = z;
    } else {
      r.scales[p] = F16((hi - lo) / qmax);
      r.zeros[p] = F16(lo);
      *s_out = F32(r.scales[p]);
      *z_out = F32(r.zeros[p]);
    }
    *inv_out = *s_out > 0 ? 1.0f / *s_out : 0.0f;
  };
  // V's range of a group as its parameters take it: +0 for a zero (-0 and +0 compare equal, so
  // which one a min or max keeps depends on the order of the scan, and the vector scan's
  // differs), and SKVQ's clipping.
  auto clip_range = [&](float& lo, float& hi) {
    lo += 0.0f;
    hi += 0.0f;
    if (clip != 1.0f && lo <= hi) {
      lo *= clip;
      hi *= clip;
    }
  };
  auto quantize_row = [&](size_t base, uint32_t d0, uint32_t d1, const float* s, const float* z,
                          const float* iv) {
    if (simd) {
      internal::QuantizeRowAvx2(&x.x[base + d0], z + d0, iv + d0, d1 - d0, qmax, &codes[base + d0]);
    } else {
      for (uint32_t d = d0; d < d1; ++d) {
        codes[base + d] = internal::AffineCode(x.x[base + d], z[d], iv[d], qmax);
      }
    }
    if (residual == nullptr) return;
    if (simd) {
      internal::DequantRowAvx2(&codes[base + d0], z + d0, s + d0, d1 - d0, &residual[base + d0]);
    } else {
      for (uint32_t d = d0; d < d1; ++d) {
        residual[base + d] = z[d] + static_cast<float>(codes[base + d]) * s[d];
      }
    }
    for (uint32_t d = d0; d < d1; ++d) residual[base + d] = x.x[base + d] - residual[base + d];
  };
  for (uint32_t h = 0; h < H; ++h) {
    if (per_channel) {
      // K: one group = gs tokens of one channel; scan rows so memory is read in order.
      for (uint32_t g = 0; g < groups; ++g) {
        const uint32_t t0 = g * gs, t1 = std::min(T, t0 + gs);
        std::fill(mn.begin(), mn.end(), INFINITY);
        std::fill(mx.begin(), mx.end(), -INFINITY);
        if (simd) {
          const size_t base = (size_t{h} * T + t0) * D;
          internal::ColumnMinMaxAvx2(&x.x[base], D, t1 - t0, D, mn.data(), mx.data(),
                                     masked ? &mask[base] : nullptr);
        } else {
          for (uint32_t t = t0; t < t1; ++t) {
            const size_t base = (size_t{h} * T + t) * D;
            for (uint32_t d = 0; d < D; ++d) {
              const float v = x.x[base + d];
              const bool skip = masked && mask[base + d];
              mn[d] = skip ? mn[d] : std::min(mn[d], v);
              mx[d] = skip ? mx[d] : std::max(mx[d], v);
            }
          }
        }
        const size_t p0 = (size_t{h} * groups + g) * D;
        if (simd && !fp8_meta) {
          internal::AffineParamsAvx2(mn.data(), mx.data(), D, qmax, &r.scales[p0], &r.zeros[p0],
                                     scale.data(), zero.data(), inv.data());
        } else if (simd) {
          internal::AffineParamsFp8Avx2(mn.data(), mx.data(), D, qmax, r.multipliers[0],
                                        r.multipliers[1], &r.scales8[p0], &r.zeros8[p0],
                                        scale.data(), zero.data(), inv.data());
        } else {
          for (uint32_t d = 0; d < D; ++d) {
            params(mn[d], mx[d], p0 + d, &scale[d], &zero[d], &inv[d]);
          }
        }
        for (uint32_t t = t0; t < t1; ++t) {
          quantize_row((size_t{h} * T + t) * D, 0, D, scale.data(), zero.data(), inv.data());
        }
      }
    } else {
      // V: one group = gs channels of one token.
      if (simd && gs % 8 == 0) {
        // Every token of the head at once: ranges, then all parameters in one vector pass
        // (a token has only a few groups), then the codes.
        const size_t n = size_t{T} * groups, p0 = size_t{h} * n;
        glo.resize(n);
        ghi.resize(n);
        gs_scale.resize(n);
        gs_zero.resize(n);
        gs_inv.resize(n);
        const size_t head = size_t{h} * T * D;
        internal::GroupMinMaxAvx2(&x.x[head], T, D, gs, glo.data(), ghi.data(),
                                  masked ? &mask[head] : nullptr);
        for (size_t i = 0; i < n; ++i) clip_range(glo[i], ghi[i]);
        if (fp8_meta) {
          internal::AffineParamsFp8Avx2(glo.data(), ghi.data(), static_cast<uint32_t>(n), qmax,
                                        r.multipliers[0], r.multipliers[1], &r.scales8[p0],
                                        &r.zeros8[p0], gs_scale.data(), gs_zero.data(),
                                        gs_inv.data());
        } else {
          internal::AffineParamsAvx2(glo.data(), ghi.data(), static_cast<uint32_t>(n), qmax,
                                     &r.scales[p0], &r.zeros[p0], gs_scale.data(), gs_zero.data(),
                                     gs_inv.data());
        }
        for (uint32_t t = 0; t < T; ++t) {
          const size_t base = (size_t{h} * T + t) * D, pt = size_t{t} * groups;
          internal::QuantizeGroupsAvx2(&x.x[base], &gs_zero[pt], &gs_inv[pt], D, gs, qmax,
                                       &codes[base]);
          if (residual == nullptr) continue;
          for (uint32_t g = 0; g < groups; ++g) {  // as quantize_row's: zero + code * scale
            const float z = gs_zero[pt + g], sc = gs_scale[pt + g];
            for (uint32_t d = g * gs; d < std::min(D, (g + 1) * gs); ++d) {
              const float dequant = z + static_cast<float>(codes[base + d]) * sc;
              residual[base + d] = x.x[base + d] - dequant;
            }
          }
        }
        continue;
      }
      for (uint32_t t = 0; t < T; ++t) {
        const size_t base = (size_t{h} * T + t) * D;
        for (uint32_t g = 0; g < groups; ++g) {
          const uint32_t d0 = g * gs, d1 = std::min(D, d0 + gs);
          float lo = INFINITY, hi = -INFINITY;
          for (uint32_t d = d0; d < d1; ++d) {
            if (masked && mask[base + d]) continue;
            lo = std::min(lo, x.x[base + d]);
            hi = std::max(hi, x.x[base + d]);
          }
          clip_range(lo, hi);
          params(lo, hi, (size_t{h} * T + t) * groups + g, &scale[d0], &zero[d0], &inv[d0]);
          for (uint32_t d = d0 + 1; d < d1; ++d) {
            scale[d] = scale[d0];
            zero[d] = zero[d0];
            inv[d] = inv[d0];
          }
        }
        quantize_row(base, 0, D, scale.data(), zero.data(), inv.data());
      }
    }
  }
  r.packed.resize(PackedBytes(codes.size(), bits));
  if (simd) {
    internal::PackBitsAvx2(codes.data(), codes.size(), bits, r.packed.data());
  } else {
    PackBits(codes.data(), codes.size(), bits, r.packed.data());
  }
  return r;
}

// Marks the top and bottom n/2 of every vector (K: each channel over tokens; V: each token over
// channels) and returns their positions in block order ([H, D, n] for K, [H, T, n] for V): for
// each vector the bottom n/2 then the top n/2, each ascending by (value, index). One pass per
// vector keeps the current extremes in small sorted lists; most elements cost two compares.
std::vector<size_t> SelectOutliers(const HeadMajor& x, bool per_channel, uint32_t n,
                                   std::vector<uint8_t>& mask, std::vector<uint32_t>& index) {
  const uint32_t T = x.t, H = x.h, D = x.d;
  const uint32_t vectors = per_channel ? D : T;
  const uint32_t k = n / 2;
  struct Entry {
    float v;
    uint32_t i;
  };
  std::vector<size_t> positions(size_t{H} * vectors * n);
  index.resize(positions.size());
  mask.assign(x.x.size(), 0);
  if (k == 0) {
    index.clear();
    return {};
  }
  // bot[vec*k ...] ascending: the k smallest so far, bot[k-1] the largest of them.
  // top[vec*k ...] ascending: the k largest so far, top[0] the smallest of them.
  std::vector<Entry> bot(size_t{vectors} * k), top(size_t{vectors} * k);
  auto offer = [&](uint32_t vec, float v, uint32_t i) {
    Entry* b = &bot[size_t{vec} * k];
    if (v < b[k - 1].v) {  // indices rise, so an equal value never beats an earlier one here
      uint32_t p = k - 1;
      for (; p > 0 && b[p - 1].v > v; --p) b[p] = b[p - 1];
      b[p] = {v, i};
    }
    Entry* t = &top[size_t{vec} * k];
    if (v >= t[0].v) {  // equal value, later index: larger in (value, index) order
      uint32_t p = 0;
      for (; p + 1 < k && t[p + 1].v <= v; ++p) t[p] = t[p + 1];
      t[p] = {v, i};
    }
  };
  // With AVX2, a vector pass first finds the elements that pass a vector's current thresholds
  // (bot[k - 1], top[0]); only those are offered, in the same order, so the lists are the same.
  // For k <= 8 (D a multiple of 8), the thresholds are first set to their final values, the
  // k-th smallest and largest of each vector (ColumnExtremesAvx2, RowExtremesAvx2): then little
  // more than the outliers themselves is offered. An element equal to a final threshold is
  // offered too (lo is raised by one ulp, as candidates are < lo or >= hi): the lists break such
  // ties by index.
  const bool simd = internal::HaveCodecSimd();
  const bool final_thresholds = simd && k <= 8 && D % 8 == 0;
  std::vector<float> lo_thr, hi_thr;
  std::vector<uint32_t> cand(D);
  for (uint32_t h = 0; h < H; ++h) {
    std::fill(bot.begin(), bot.end(), Entry{INFINITY, 0});
    std::fill(top.begin(), top.end(), Entry{-INFINITY, 0});
    if (per_channel && final_thresholds) {
      lo_thr.resize(D);
      hi_thr.resize(D);
      internal::ColumnExtremesAvx2(&x.x[size_t{h} * T * D], T, D, k, lo_thr.data(), hi_thr.data());
      for (float& lo : lo_thr) lo = std::nextafter(lo, INFINITY);
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        const uint32_t nc =
            internal::OutlierCandidatesAvx2(row, D, lo_thr.data(), hi_thr.data(), cand.data());
        for (uint32_t c = 0; c < nc; ++c) offer(cand[c], row[cand[c]], t);
      }
    } else if (!per_channel && final_thresholds) {
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        float lo, hi;
        internal::RowExtremesAvx2(row, D, k, &lo, &hi);
        const uint32_t nc = internal::OutlierCandidatesScalarAvx2(
            row, D, std::nextafter(lo, INFINITY), hi, cand.data());
        for (uint32_t c = 0; c < nc; ++c) offer(t, row[cand[c]], cand[c]);
      }
    } else if (per_channel) {
      if (simd) {
        lo_thr.assign(D, INFINITY);
        hi_thr.assign(D, -INFINITY);
      }
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        if (!simd) {
          for (uint32_t d = 0; d < D; ++d) offer(d, row[d], t);
          continue;
        }
        const uint32_t nc =
            internal::OutlierCandidatesAvx2(row, D, lo_thr.data(), hi_thr.data(), cand.data());
        for (uint32_t c = 0; c < nc; ++c) {
          const uint32_t d = cand[c];
          offer(d, row[d], t);
          lo_thr[d] = bot[size_t{d} * k + k - 1].v;
          hi_thr[d] = top[size_t{d} * k].v;
        }
      }
    } else {
      for (uint32_t t = 0; t < T; ++t) {
        const float* row = &x.x[(size_t{h} * T + t) * D];
        if (!simd) {
          for (uint32_t d = 0; d < D; ++d) offer(t, row[d], d);
          continue;
        }
        // The row is the vector: its thresholds tighten along it, so candidates are taken 16
        // elements at a time against the thresholds so far.
        for (uint32_t d0 = 0; d0 < D; d0 += 16) {
          const uint32_t nc = internal::OutlierCandidatesScalarAvx2(
              row + d0, std::min<uint32_t>(16, D - d0), bot[size_t{t} * k + k - 1].v,
              top[size_t{t} * k].v, cand.data());
          for (uint32_t c = 0; c < nc; ++c) offer(t, row[d0 + cand[c]], d0 + cand[c]);
        }
      }
    }
    for (uint32_t vec = 0; vec < vectors; ++vec) {
      size_t* out = &positions[(size_t{h} * vectors + vec) * n];
      uint32_t* in = &index[(size_t{h} * vectors + vec) * n];
      auto pos = [&](uint32_t i) {
        return per_channel ? (size_t{h} * T + i) * D + vec : (size_t{h} * T + vec) * D + i;
      };
      for (uint32_t e = 0; e < k; ++e) {
        in[e] = bot[size_t{vec} * k + e].i;
        in[k + e] = top[size_t{vec} * k + e].i;
        out[e] = pos(in[e]);
        out[k + e] = pos(in[k + e]);
      }
    }
  }
  for (size_t p : positions) mask[p] = 1;
  return positions;
}

absl::Status CheckShape(const CodecSpec& s, const KvChunkView& c) {
  if (c.k == nullptr || c.v == nullptr) return absl::InvalidArgumentError("codec: null K or V");
  if (c.tokens < 1 || c.kv_heads < 1 || c.head_dim < 1 || c.tokens > kMaxBlockTokens ||
      c.kv_heads > kMaxKvHeads || c.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("codec: shape ", c.tokens, " tokens x ",
                                                   c.kv_heads, " heads x ", c.head_dim,
                                                   " dims is empty or too large"));
  }
  if (s.id != CodecId::kFp16 && s.id != CodecId::kBf16 && c.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", s.ToString(), ": head_dim ", c.head_dim, " is not a multiple of 8"));
  }
  if (s.is_codebook() && (c.head_dim / s.group) * s.k_bits % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", s.ToString(), ": ", c.head_dim / s.group, " codes of ", s.k_bits,
                     " bits per token do not fill whole bytes (head_dim ", c.head_dim, ")"));
  }
  return absl::OkStatus();
}

// Part writers: one part's K and V sections, from section `first` on; `c` is the part's tokens.
absl::Status WriteIdentity(const CodecSpec& s, const CodecLayout& layout, const KvChunkView& c,
                           BlockBuilder& b, int first) {
  const bool f16 = s.id == CodecId::kFp16;
  const float limit = f16 ? 65504.0f : INFINITY;
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, limit));
    if (f16) {
      FloatToHalf(m.x.data(), b.section_as<Half>(section), m.x.size());
    } else {
      FloatToBFloat16(m.x.data(), b.section_as<BFloat16>(section), m.x.size());
    }
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

// CQ: each token's runs of `group` channels as the index of the nearest centroid of the layer's
// codebook for that head and run (codebook.h).
absl::Status WriteCodebook(const CodecSpec& s, const CodecLayout& layout, const KvChunkView& c,
                           BlockBuilder& b, int first, const LayerCalibration* cal) {
  const int coupled = s.group, bits = s.k_bits;
  const uint32_t G = c.head_dim / coupled, K = 1u << bits;
  int section = first;
  for (const auto& [src, name, book] :
       {std::tuple{c.k, "K", cal != nullptr ? &cal->k_codebook : nullptr},
        std::tuple{c.v, "V", cal != nullptr ? &cal->v_codebook : nullptr}}) {
    if (book == nullptr || book->size() != size_t{c.kv_heads} * c.head_dim * K) {
      return absl::FailedPreconditionError(absl::StrCat(
          "codec ", s.ToString(), ": the calibration holds no ", name, " codebooks for ",
          c.kv_heads, " heads of ", c.head_dim, " (strata calibrate makes them)"));
    }
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, kMetadataLimit));
    if (s.token_norm) {  // head-major rows [H, T, D]: one "token" per (head, token)
      NormalizeRows(m.x.data(), c.kv_heads * c.tokens, 1, c.head_dim,
                    b.section_as<uint16_t>(section + 1));
    }
    std::vector<uint8_t> codes(size_t{c.kv_heads} * c.tokens * G);
    std::vector<float> cent(size_t{K} * coupled);
    for (uint32_t h = 0; h < c.kv_heads; ++h) {
      for (uint32_t g = 0; g < G; ++g) {
        const uint16_t* src_book = &(*book)[(size_t{h} * G + g) * K * coupled];
        for (size_t e = 0; e < cent.size(); ++e) cent[e] = F32(src_book[e]);
        for (uint32_t t = 0; t < c.tokens; ++t) {
          codes[(size_t{h} * c.tokens + t) * G + g] = static_cast<uint8_t>(
              NearestCentroid(&m.at(h, t, g * coupled), cent.data(), K, coupled));
        }
      }
    }
    PackBits(codes.data(), codes.size(), bits, b.section(section).data());
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

absl::Status WriteInt8(const CodecSpec&, const CodecLayout& layout, const KvChunkView& c,
                       BlockBuilder& b, int first) {
  const uint32_t D = c.head_dim;
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, kMetadataLimit));
    int8_t* codes = b.section_as<int8_t>(section);
    uint16_t* scales = b.section_as<uint16_t>(section + 1);
    for (size_t row = 0; row < m.x.size() / D; ++row) {
      const float* x = &m.x[row * D];
      const float amax = MaxAbs(x, D);
      scales[row] = F16(amax / 127.0f);
      const float scale = F32(scales[row]);
      const float inv = scale > 0 ? 1.0f / scale : 0.0f;
      if (internal::HaveCodecSimd()) {
        internal::QuantizeInt8Avx2(x, D, inv, &codes[row * D]);
        continue;
      }
      for (uint32_t d = 0; d < D; ++d) {  // round half away from zero
        const float y = x[d] * inv;
        const float q = static_cast<float>(static_cast<int32_t>(y + (y >= 0 ? 0.5f : -0.5f)));
        codes[row * D + d] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

absl::Status WriteFp8(const CodecSpec&, const CodecLayout& layout, const KvChunkView& c,
                      BlockBuilder& b, int first) {
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    STRATA_ASSIGN_OR_RETURN(HeadMajor m, ToHeadMajor(c, src, name, INFINITY));
    const bool simd = internal::HaveCodecSimd();
    const float amax = MaxAbs(m.x.data(), m.x.size());
    const float scale = amax > 0 ? amax / kFp8E4M3Max : 1.0f;
    const float inv = 1.0f / scale;
    uint8_t* codes = b.section_as<uint8_t>(section);
    if (simd) {
      internal::ScaleToFp8E4M3Avx2(m.x.data(), m.x.size(), inv, codes);
    } else {
      for (size_t i = 0; i < m.x.size(); ++i) codes[i] = FloatToFp8E4M3(m.x[i] * inv);
    }
    std::memcpy(b.section(section + 1).data(), &scale, sizeof(scale));
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

absl::Status WriteAffine(const CodecSpec& s, const CodecLayout& layout, const KvChunkView& c,
                         BlockBuilder& b, int first, const LayerCalibration* cal) {
  const uint32_t T = c.tokens, H = c.kv_heads, D = c.head_dim;
  int section = first;
  for (const auto& [src, name] : {std::pair{c.k, "K"}, std::pair{c.v, "V"}}) {
    const bool is_k = section == first;
    const TensorLayout& tl = is_k ? layout.k : layout.v;
    // SKVQ stores channels in calibrated order.
    const std::vector<uint16_t>* perm = cal == nullptr ? nullptr
                                        : is_k         ? &cal->k_perm
                                                       : &cal->v_perm;
    STRATA_ASSIGN_OR_RETURN(
        HeadMajor m, ToHeadMajor(c, src, name, kMetadataLimit,
                                 perm != nullptr && !perm->empty() ? perm->data() : nullptr));
    const float clip = cal == nullptr ? 1.0f : is_k ? cal->k_clip : cal->v_clip;
    std::vector<uint16_t> head_mean;
    if (s.id == CodecId::kTada) {  // mean over heads (as fp16 will store it); deviations remain
      head_mean.resize(size_t{T} * D);
      if (internal::HaveCodecSimd() && D % 8 == 0) {
        internal::HeadMeanAvx2(m.x.data(), H, T, D, head_mean.data());
      } else {
        for (uint32_t t = 0; t < T; ++t) {
          for (uint32_t d = 0; d < D; ++d) {
            float sum = 0;
            for (uint32_t h = 0; h < H; ++h) sum += m.at(h, t, d);
            head_mean[size_t{t} * D + d] = F16(sum / H);
            const float mean = F32(head_mean[size_t{t} * D + d]);
            for (uint32_t h = 0; h < H; ++h) m.at(h, t, d) -= mean;
          }
        }
      }
    }
    std::vector<uint16_t> norms;
    if (s.id == CodecId::kZipCache && !is_k) {
      // Channel-separable tokenwise quantization: each channel divided by sqrt(max |x|) of the
      // part, per-token groups, the divisor multiplied back at attention.
      norms.resize(size_t{H} * D);
      if (internal::HaveCodecSimd() && D % 8 == 0) {
        internal::ChannelNormsAvx2(m.x.data(), H, T, D, norms.data());
      } else {
        for (uint32_t h = 0; h < H; ++h) {
          for (uint32_t d = 0; d < D; ++d) {
            float mx = 0;
            for (uint32_t t = 0; t < T; ++t) mx = std::max(mx, std::fabs(m.at(h, t, d)));
            norms[size_t{h} * D + d] = F16(mx > 0 ? std::sqrt(mx) : 1.0f);
            const float inv = 1.0f / F32(norms[size_t{h} * D + d]);
            for (uint32_t t = 0; t < T; ++t) m.at(h, t, d) *= inv;
          }
        }
      }
    }
    std::vector<uint8_t> mask;
    std::vector<size_t> outliers;
    std::vector<uint32_t> outlier_index;  // each outlier's token (K) or channel (V)
    if (tl.outliers > 0) outliers = SelectOutliers(m, is_k, tl.outliers, mask, outlier_index);
    const int bits = is_k ? s.k_bits : s.v_bits;
    // The residual after the backbone only where GEAR takes low-rank terms or outliers from it.
    AffineResult q = QuantizeAffine(m, !tl.token_groups, tl.group_size, tl.groups, bits, mask, clip,
                                    s.fp8_meta, tl.rank > 0 || tl.outliers > 0);

    int next = section;
    Put(b, next++, q.packed);
    if (s.fp8_meta) {
      Put(b, next++, q.scales8);
      Put(b, next++, q.zeros8);
      std::memcpy(b.section(next++).data(), q.multipliers, sizeof(q.multipliers));
    } else {
      Put(b, next++, q.scales);
      Put(b, next++, q.zeros);
    }
    if (!head_mean.empty()) Put(b, next++, head_mean);
    if (!norms.empty()) Put(b, next++, norms);
    if (tl.rank == 0 && tl.outliers == 0) {
      section += layout.k_section_count;
      continue;
    }
    // The residual after the backbone; outliers then take exactly what the backbone missed.
    Scratch<float>& residual = q.residual;
    // (The fp16 conversions by the array functions: F16C where present, the same bits.)
    std::vector<Half> outlier_values(outliers.size());
    {
      std::vector<float> picked(outliers.size());
      for (size_t i = 0; i < outliers.size(); ++i) picked[i] = residual[outliers[i]];
      FloatToHalf(picked.data(), outlier_values.data(), picked.size());
      HalfToFloat(outlier_values.data(), picked.data(), picked.size());
      for (size_t i = 0; i < outliers.size(); ++i) residual[outliers[i]] -= picked[i];
    }
    if (tl.rank > 0) {
      std::vector<float> a(size_t{T} * tl.rank), bm(size_t{D} * tl.rank);
      std::vector<Half> a16(size_t{H} * T * tl.rank), b16(size_t{H} * D * tl.rank);
      for (uint32_t h = 0; h < H; ++h) {
        LowRankApproximate(&residual[size_t{h} * T * D], static_cast<int>(T), static_cast<int>(D),
                           static_cast<int>(tl.rank), s.power_iterations,
                           /*seed=*/0x5eed0000u + h, a.data(), bm.data());
        FloatToHalf(a.data(), &a16[h * a.size()], a.size());
        FloatToHalf(bm.data(), &b16[h * bm.size()], bm.size());
      }
      Put(b, next++, a16);
      Put(b, next++, b16);
    }
    if (tl.outliers > 0) {
      Put(b, next++, outlier_values);
      // The index of each outlier within its vector: the token (K) or the channel (V).
      if (tl.index_type == ElemType::kUInt8) {
        uint8_t* idx = b.section_as<uint8_t>(next++);
        for (size_t i = 0; i < outliers.size(); ++i) {
          idx[i] = static_cast<uint8_t>(outlier_index[i]);
        }
      } else {
        uint16_t* idx = b.section_as<uint16_t>(next++);
        for (size_t i = 0; i < outliers.size(); ++i) {
          idx[i] = static_cast<uint16_t>(outlier_index[i]);
        }
      }
    }
    section += layout.k_section_count;
  }
  return absl::OkStatus();
}

// ZipCache's token saliency: the normalized attention score of each token under probe queries
// (the p % most recent tokens' queries plus p % drawn at random from the rest, deterministic per
// layer and chunk): for every probe query and query head, softmax over the tokens it can see
// (itself and earlier tokens of the chunk), summed per token, divided by the number of probes
// that can see it. Without queries, falls back to how far each token lies from the chunk's
// per-channel means (K and V, in channel standard deviations): outlier tokens are what low bits
// hurt most.
std::vector<double> Saliency(const CodecSpec& s, const KvChunkView& c, const BlockContext& ctx) {
  const uint32_t T = c.tokens, H = c.kv_heads, D = c.head_dim;
  const size_t row = size_t{H} * D;
  std::vector<float> k(T * row);
  for (uint32_t t = 0; t < T; ++t) SourceRow(c.k, c.dtype, t * row, row, &k[t * row]);
  std::vector<double> sal(T, 0.0);
  if (c.q == nullptr) {
    std::vector<float> v(T * row);
    for (uint32_t t = 0; t < T; ++t) SourceRow(c.v, c.dtype, t * row, row, &v[t * row]);
    for (const std::vector<float>* x : {&k, &v}) {
      for (size_t e = 0; e < row; ++e) {
        double mean = 0, var = 0;
        for (uint32_t t = 0; t < T; ++t) mean += (*x)[t * row + e];
        mean /= T;
        for (uint32_t t = 0; t < T; ++t) var += std::pow((*x)[t * row + e] - mean, 2);
        const double inv = var > 0 ? 1.0 / (var / T) : 0.0;
        for (uint32_t t = 0; t < T; ++t) sal[t] += std::pow((*x)[t * row + e] - mean, 2) * inv;
      }
    }
    return sal;
  }
  const uint32_t QH = c.q_heads, G = QH / H;
  const uint32_t per =
      std::max<uint32_t>(1, static_cast<uint32_t>(std::floor(T * s.probe_percent / 100.0 + 0.5)));
  std::vector<uint32_t> probes;
  for (uint32_t i = T - std::min(per, T); i < T; ++i) probes.push_back(i);
  if (T > per) {  // random probes among the earlier tokens, without repetition
    std::vector<uint32_t> rest(T - per);
    std::iota(rest.begin(), rest.end(), 0u);
    uint64_t state = 0x9e3779b97f4a7c15ull ^ (uint64_t{ctx.layer} << 32) ^ ctx.chunk_index;
    const uint32_t n = std::min<uint32_t>(per, static_cast<uint32_t>(rest.size()));
    for (uint32_t i = 0; i < n; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const uint32_t j = i + static_cast<uint32_t>((state >> 33) % (rest.size() - i));
      std::swap(rest[i], rest[j]);
      probes.push_back(rest[i]);
    }
  }
  std::vector<uint32_t> seen_by(T, 0);
  // dots[g][t]: q . k_t in float, one fused multiply-add per channel in ascending order, for the
  // G query heads of one KV head. With AVX2 eight tokens to a vector from the head's keys
  // transposed (kt [D][T]): the same chains, so the same saliency. The softmax is in double.
  const bool simd = internal::HaveCodecSimd();
  std::vector<float> kt;
  std::vector<float> dots(size_t{G} * T), p(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (simd) {
    kt.resize(size_t{H} * D * T);
    for (uint32_t h = 0; h < H; ++h) {
      internal::TransposeAvx2(&k[size_t{h} * D], row, T, D, &kt[size_t{h} * D * T], T);
    }
  }
  for (uint32_t i : probes) {
    for (uint32_t t = 0; t <= i; ++t) ++seen_by[t];
    for (uint32_t h = 0; h < H; ++h) {
      const float* q0 = c.q + (size_t{i} * QH + size_t{h} * G) * D;
      if (simd) {
        internal::ProbeDotsAvx2(&kt[size_t{h} * D * T], T, D, q0, G, i + 1, dots.data());
      } else {
        for (uint32_t g = 0; g < G; ++g) {
          const float* q = q0 + size_t{g} * D;
          for (uint32_t t = 0; t <= i; ++t) {
            const float* kv = &k[t * row + size_t{h} * D];
            float dot = 0.0f;
            for (uint32_t d = 0; d < D; ++d) dot = std::fma(q[d], kv[d], dot);
            dots[size_t{g} * T + t] = dot;
          }
        }
      }
      for (uint32_t g = 0; g < G; ++g) {  // query head h * G + g, in order
        const float* dot = &dots[size_t{g} * T];
        if (simd) {
          internal::ProbeWeightsAvx2(dot, i + 1, scale, p.data());
        } else {
          float mx = -INFINITY;
          for (uint32_t t = 0; t <= i; ++t) mx = std::max(mx, dot[t] * scale);
          for (uint32_t t = 0; t <= i; ++t) p[t] = internal::ExpScalar(dot[t] * scale - mx);
        }
        double sum = 0;
        for (uint32_t t = 0; t <= i; ++t) sum += p[t];
        const double inv = 1.0 / sum;
        for (uint32_t t = 0; t <= i; ++t) sal[t] += p[t] * inv;
      }
    }
  }
  for (uint32_t t = 0; t < T; ++t) sal[t] = seen_by[t] > 0 ? sal[t] / seen_by[t] : 0.0;
  return sal;
}

// The part of each token of a chunk (indices into spec.PartSpecs()).
std::vector<uint8_t> AssignParts(const CodecSpec& s, const KvChunkView& c,
                                 const BlockContext& ctx) {
  const uint32_t T = c.tokens;
  uint8_t next = 0;
  const uint8_t sink_part = s.sink_tokens > 0 ? next++ : 0;
  const bool zip = s.id == CodecId::kZipCache && s.salient_percent > 0;
  const uint8_t hi_part = zip ? next++ : 0;
  const uint8_t main_part = next;
  std::vector<uint8_t> map(T, main_part);
  uint32_t sinks = 0;
  if (s.sink_tokens > 0 && ctx.chunk_index == 0) {
    sinks = std::min<uint32_t>(static_cast<uint32_t>(s.sink_tokens), T);
    std::fill(map.begin(), map.begin() + sinks, sink_part);
  }
  if (zip && sinks < T) {
    const std::vector<double> sal = Saliency(s, c, ctx);
    std::vector<uint32_t> order(T - sinks);
    std::iota(order.begin(), order.end(), sinks);
    const uint32_t n = std::min<uint32_t>(static_cast<uint32_t>(order.size()),
                                          s.SalientTokens(static_cast<uint32_t>(order.size())));
    std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](uint32_t a, uint32_t b) {
      return sal[a] != sal[b] ? sal[a] > sal[b] : a < b;
    });
    for (uint32_t i = 0; i < n; ++i) map[order[i]] = hi_part;
  }
  return map;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Codec>> Codec::Create(
    absl::string_view text, std::shared_ptr<const Calibration> calibration) {
  STRATA_ASSIGN_OR_RETURN(CodecSpec s, CodecSpec::Parse(text));
  CodecSpec main = s;
  main.sink_tokens = 0;
  const bool for_this = calibration != nullptr && calibration->codec == main.ToString();
  if (s.needs_calibration()) {
    if (calibration == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "codec ", s.ToString(), " needs a calibration file (make one with strata calibrate)"));
    }
    if (!for_this) {
      return absl::FailedPreconditionError(absl::StrCat(
          "codec ", s.ToString(), ": the calibration was made for '", calibration->codec, "'"));
    }
  } else if (!(s.searches_layers() && for_this)) {
    calibration = nullptr;  // nothing to record
  }
  if (calibration != nullptr && s.searches_layers()) {
    // The calibration chose each layer's codec: blocks are made by (and carry) that codec.
    std::vector<std::unique_ptr<Codec>> layers;
    for (size_t l = 0; l < calibration->layers.size(); ++l) {
      const std::string& ls = calibration->layers[l].spec;
      if (ls.empty()) {
        if (s.id == CodecId::kStrata) {
          return absl::FailedPreconditionError(absl::StrCat(
              "codec ", s.ToString(), ": the calibration chose no codec for layer ", l));
        }
        layers.push_back(std::make_unique<Codec>(s, calibration));
        continue;
      }
      STRATA_ASSIGN_OR_RETURN(CodecSpec lspec, CodecSpec::Parse(ls));
      layers.push_back(std::make_unique<Codec>(lspec, calibration));
    }
    auto codec = std::make_unique<Codec>(s, calibration);
    codec->layer_codecs_ = std::move(layers);
    return codec;
  }
  switch (s.id) {
    case CodecId::kFp16:
    case CodecId::kBf16:
    case CodecId::kInt8:
    case CodecId::kFp8E4M3:
    case CodecId::kKivi:
    case CodecId::kKcvt:
    case CodecId::kGear:
    case CodecId::kGearL:
    case CodecId::kZipCache:
    case CodecId::kSkvq:
    case CodecId::kTada:
    case CodecId::kCq:
      return std::make_unique<Codec>(s, std::move(calibration));
    default:
      break;
  }
  return absl::UnimplementedError(absl::StrCat("codec ", s.ToString(), " is not implemented yet"));
}

std::string Codec::LayerSpec(uint32_t layer) const {
  if (layer < layer_codecs_.size()) return layer_codecs_[layer]->spec().ToString();
  return spec_.ToString();
}

absl::StatusOr<AlignedBuffer> Codec::Encode(const KvChunkView& c, const BlockContext& ctx) const {
  STRATA_ASSIGN_OR_RETURN(BlockBuilder b, Build(c, ctx, nullptr));
  return std::move(b).Finish();
}

absl::StatusOr<size_t> Codec::EncodeInto(const KvChunkView& c, const BlockContext& ctx,
                                         const BlockAllocator& allocate) const {
  if (!allocate) return absl::InvalidArgumentError("codec: EncodeInto without an allocator");
  STRATA_ASSIGN_OR_RETURN(BlockBuilder b, Build(c, ctx, &allocate));
  return std::move(b).Seal();
}

absl::StatusOr<BlockBuilder> Codec::Build(const KvChunkView& c, const BlockContext& ctx,
                                          const BlockAllocator* allocate) const {
  if (!layer_codecs_.empty()) {
    if (ctx.layer >= layer_codecs_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("codec ", spec_.ToString(), ": layer ",
                                                     ctx.layer, " beyond the calibration's ",
                                                     layer_codecs_.size()));
    }
    return layer_codecs_[ctx.layer]->Build(c, ctx, allocate);
  }
  const CodecSpec& s = spec_;
  if (s.id == CodecId::kStrata) {
    return absl::FailedPreconditionError("codec strata: no per-layer choice (calibration)");
  }
  STRATA_RETURN_IF_ERROR(CheckShape(s, c));
  if (c.q != nullptr && (c.q_heads == 0 || c.q_heads % c.kv_heads != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codec: ", c.q_heads, " query heads are not a multiple of ", c.kv_heads, " KV heads"));
  }
  const LayerCalibration* layer_cal = nullptr;
  if (calibration_ != nullptr) {
    if (ctx.layer >= calibration_->layers.size() || calibration_->kv_heads != c.kv_heads ||
        calibration_->head_dim != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "codec ", s.ToString(), ": layer ", ctx.layer, " of ", c.kv_heads, "x", c.head_dim,
          " is not covered by the calibration (", calibration_->layers.size(), " layers of ",
          calibration_->kv_heads, "x", calibration_->head_dim, ")"));
    }
    layer_cal = &calibration_->layers[ctx.layer];
  }
  const std::vector<CodecSpec> part_specs = s.PartSpecs();
  std::vector<uint8_t> map;  // the part of each token, when the spec has parts
  std::vector<uint32_t> counts(part_specs.size(), 0);
  if (s.has_parts()) {
    map = AssignParts(s, c, ctx);
    for (uint8_t p : map) ++counts[p];
  } else {
    counts[0] = c.tokens;
  }
  const BlockPartsLayout layout = MakeBlockLayout(s, counts, c.kv_heads, c.head_dim);
  const std::string text = s.ToString();  // the header views it
  BlockHeader h;
  h.codec = s.id;
  h.codec_spec = text;
  h.source_dtype = c.dtype;
  h.layer = ctx.layer;
  h.chunk_index = ctx.chunk_index;
  h.token_count = c.tokens;
  h.kv_heads = c.kv_heads;
  h.head_dim = c.head_dim;
  h.model_fingerprint = ctx.model_fingerprint;
  h.calibration_fingerprint = calibration_ != nullptr ? calibration_->fingerprint() : 0;
  STRATA_ASSIGN_OR_RETURN(
      BlockBuilder b, allocate != nullptr ? BlockBuilder::CreateIn(h, layout.sections, *allocate)
                                          : BlockBuilder::Create(h, layout.sections));
  if (layout.has_map) std::memcpy(b.section(0).data(), map.data(), map.size());
  std::vector<float> pk, pv;  // one part's tokens, gathered
  for (size_t p = 0; p < part_specs.size(); ++p) {
    if (counts[p] == 0) continue;
    KvChunkView part = c;
    part.tokens = counts[p];
    part.q = nullptr;
    if (layout.has_map) {
      const size_t row = size_t{c.kv_heads} * c.head_dim;
      pk.resize(counts[p] * row);
      pv.resize(counts[p] * row);
      size_t i = 0;
      for (uint32_t t = 0; t < c.tokens; ++t) {
        if (map[t] != p) continue;
        SourceRow(c.k, c.dtype, t * row, row, &pk[i * row]);
        SourceRow(c.v, c.dtype, t * row, row, &pv[i * row]);
        ++i;
      }
      part.k = pk.data();
      part.v = pv.data();
      part.dtype = SourceDType::kFloat32;
    }
    const CodecSpec& ps = part_specs[p];
    const CodecLayout& pl = layout.parts[p];
    const int first = layout.first_section[p];
    switch (ps.id) {
      case CodecId::kFp16:
      case CodecId::kBf16:
        STRATA_RETURN_IF_ERROR(WriteIdentity(ps, pl, part, b, first));
        break;
      case CodecId::kInt8:
        STRATA_RETURN_IF_ERROR(WriteInt8(ps, pl, part, b, first));
        break;
      case CodecId::kFp8E4M3:
        STRATA_RETURN_IF_ERROR(WriteFp8(ps, pl, part, b, first));
        break;
      case CodecId::kCq:
        STRATA_RETURN_IF_ERROR(WriteCodebook(ps, pl, part, b, first, layer_cal));
        break;
      default:
        STRATA_RETURN_IF_ERROR(
            WriteAffine(ps, pl, part, b, first, ps.id == CodecId::kSkvq ? layer_cal : nullptr));
        break;
    }
  }
  return b;
}

absl::StatusOr<double> Codec::BitsPerElement(uint32_t tokens, uint32_t kv_heads, uint32_t head_dim,
                                             uint32_t chunk_index) const {
  const BlockPartsLayout layout =
      MakeBlockLayout(spec_, DefaultPartTokens(spec_, tokens, chunk_index), kv_heads, head_dim);
  const std::string text = spec_.ToString();
  BlockHeader h;
  h.codec = spec_.id;
  h.codec_spec = text;
  h.token_count = tokens;
  h.kv_heads = kv_heads;
  h.head_dim = head_dim;
  STRATA_ASSIGN_OR_RETURN(BlockLayout l, BlockLayout::Plan(h, layout.sections));
  return l.total_bytes() * 8.0 / (2.0 * tokens * kv_heads * head_dim);
}

}  // namespace strata::kernels
