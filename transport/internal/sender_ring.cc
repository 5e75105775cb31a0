#include "transport/internal/sender_ring.h"

#include <algorithm>
#include <iterator>

#include "transport/block_protocol.h"

namespace strata::transport::internal {

SenderRing::~SenderRing() {
  if (mem.empty()) return;
  if (std::shared_ptr<Endpoint> e = ep.lock()) e->Unmap(mem.data());
}

uint64_t SenderRing::Need(uint64_t size) {
  return (kPlacedPrefixBytes + std::max<uint64_t>(size, 1) + 255) / 256 * 256;
}

void SenderRing::Lend(std::span<uint8_t> m) {
  mem = m;
  free_.clear();
  free_[0] = m.size();
  state = State::kReady;
}

std::optional<uint64_t> SenderRing::Allocate(uint64_t size, uint64_t seq) {
  const uint64_t need = Need(size);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t at = it->first;
    const uint64_t left = it->second - need;
    free_.erase(it);
    if (left > 0) free_[at + need] = left;
    used_[at + kPlacedPrefixBytes] = {.bytes = need, .seq = seq};
    return at + kPlacedPrefixBytes;
  }
  return std::nullopt;
}

bool SenderRing::FitsIfReclaimed(uint64_t size, absl::Time before) const {
  std::map<uint64_t, uint64_t> space = free_;
  bool any = false;
  for (const auto& [offset, since] : doubtful_) {
    if (since > before) continue;
    space[offset - kPlacedPrefixBytes] = used_.at(offset).bytes;
    any = true;
  }
  uint64_t run_start = 0, run = 0;
  for (const auto& [at, len] : space) {  // longest run of adjacent extents
    if (run == 0 || at != run_start + run) {
      run_start = at;
      run = 0;
    }
    run += len;
    if (any && run >= Need(size)) return true;
  }
  return false;
}

bool SenderRing::Release(uint64_t offset) {
  if (auto c = copying_.find(offset); c != copying_.end()) {
    c->second = true;
    return true;
  }
  auto u = used_.find(offset);
  if (u == used_.end()) return false;
  uint64_t start = offset - kPlacedPrefixBytes, len = u->second.bytes;
  used_.erase(u);
  doubtful_.erase(offset);
  auto next = free_.find(start + len);
  if (next != free_.end()) {
    len += next->second;
    free_.erase(next);
  }
  auto after = free_.lower_bound(start);
  if (after != free_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = len;
  return true;
}

void SenderRing::CopyStopped(uint64_t offset) {
  auto c = copying_.find(offset);
  if (c == copying_.end()) return;
  const bool released = c->second;
  copying_.erase(c);
  if (released) Release(offset);
}

void SenderRing::Unanswered(uint64_t offset, uint64_t seq, absl::Time when) {
  auto u = used_.find(offset);
  if (u != used_.end() && u->second.seq == seq) doubtful_[offset] = when;
}

uint64_t SenderRing::free_bytes() const {
  uint64_t n = 0;
  for (const auto& [at, len] : free_) n += len;
  return n;
}

}  // namespace strata::transport::internal
