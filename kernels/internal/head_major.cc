#include "kernels/internal/head_major.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/internal/codec_simd.h"

namespace strata::kernels::internal {

ScratchCache::~ScratchCache() {
  for (const Block& b : blocks_) ::operator delete(b.p);
}

void* ScratchCache::Get(size_t bytes, size_t* size) {
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

void ScratchCache::Put(void* p, size_t size) {
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

ScratchCache& ScratchCache::ThisThread() {
  thread_local ScratchCache cache;
  return cache;
}

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

// With `perm`, eight tokens at a time while they are in cache.
absl::StatusOr<HeadMajor> ToHeadMajor(const KvChunkView& c, const void* src, const char* name,
                                      float limit, const uint16_t* perm) {
  HeadMajor m;
  m.t = c.tokens;
  m.h = c.kv_heads;
  m.d = c.head_dim;
  m.x.resize(size_t{m.t} * m.h * m.d);
  const bool simd = HaveCodecSimd();
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
        all = HalfToFloatPermutedWithinAvx2(
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
          ok = HalfToFloatWithinAvx2(static_cast<const uint16_t*>(src) + offset, m.d, limit, dst);
        } else if (simd) {
          SourceRow(src, c.dtype, offset, m.d, dst);
          ok = AllWithinAvx2(dst, m.d, limit);
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
        PermuteRowsAvx2(&m.at(head, tok0, 0), tok1 - tok0, m.d, p);
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

float MaxAbs(const float* x, size_t n) {
  if (HaveCodecSimd()) return MaxAbsAvx2(x, n, 0.0f);
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

}  // namespace strata::kernels::internal
