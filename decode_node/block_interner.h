// BlockInterner: the blocks a decode node's sequences hold, by block name, so that sequences
// that adopted the same cached prefix hold one copy of its bytes. Each request's blocks arrive
// in buffers of their own (or come from the store per request); a block whose name and bytes
// another live sequence already holds is adopted from those bytes instead, and the new buffer is
// released. Besides the memory, equal bytes let the attention kernels read a prefix that several
// sequences of a batch share once per step for all of them (DecodeAttentionOptions::
// share_prefixes).
//
// Entries are weak: a block is held by the sequences that adopted it, never by the interner, and
// is forgotten once the last of them lets it go. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "common/shared_bytes.h"

namespace strata::decode {

class BlockInterner {
 public:
  // Bytes equal to `bytes` that a live holder already has under `name` (`*shared` true), or
  // `bytes` itself, remembered under `name` for later callers (`*shared` false). Bytes that
  // differ under one name (never expected: a block's name fixes its content) are not shared.
  SharedBytes Intern(const std::string& name, SharedBytes bytes, bool* shared);

  // Whether a live holder has bytes under `name` (a sequence being admitted would adopt them
  // from that holder instead of keeping its own).
  bool Holds(const std::string& name) const;

  // Names remembered, live or not yet swept (for tests).
  size_t size() const;

 private:
  struct Entry {
    std::weak_ptr<const void> owner;
    absl::Span<const uint8_t> bytes;
  };
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_;
  size_t sweep_at_ = 1024;  // drop dead entries when the map reaches this size
};

}  // namespace strata::decode
