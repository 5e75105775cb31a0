#include "decode_node/block_interner.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace strata::decode {

SharedBytes BlockInterner::Intern(const std::string& name, SharedBytes bytes, bool* shared) {
  *shared = false;
  if (!bytes) return bytes;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(name);
  if (it != entries_.end()) {
    if (std::shared_ptr<const void> owner = it->second.owner.lock()) {
      const absl::Span<const uint8_t> held = it->second.bytes;
      if (held.size() == bytes.size() &&
          (held.data() == bytes.data() ||
           std::memcmp(held.data(), bytes.data(), held.size()) == 0)) {
        *shared = held.data() != bytes.data();
        return SharedBytes(held, std::move(owner));
      }
    }
    it->second = {bytes.owner(), bytes.span()};
    return bytes;
  }
  entries_.emplace(name, Entry{bytes.owner(), bytes.span()});
  if (entries_.size() >= sweep_at_) {
    absl::erase_if(entries_, [](const auto& e) { return e.second.owner.expired(); });
    sweep_at_ = std::max<size_t>(1024, 2 * entries_.size());
  }
  return bytes;
}

bool BlockInterner::Holds(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(name);
  return it != entries_.end() && !it->second.owner.expired();
}

size_t BlockInterner::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace strata::decode
