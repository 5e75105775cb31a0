// TierLedger: the store's tier rules over sizes alone, written once. BlockStore keeps its bytes in
// each entry (the Payload it derives from); `strata replay` (replay.h) runs the same ledger with
// no bytes at all, so the capacity figures it reports follow what the store does.
//
//   TierLedger<std::string, Copies> ledger(ram_bytes, disk_bytes, /*disk_tier=*/true, kS3Fifo);
//   auto& e = ledger.Add(key, &parent_key, bytes);        // in no tier yet
//   ledger.EvictRam(e.bytes, pinned, [&](const std::string& k, auto& v, RamFate f) { ... });
//   ledger.AddToRam(key);
//
// The rules:
// - A block belongs under its parent (the previous chunk of its chain); a chunk is only useful
//   after its whole prefix, so when a block leaves every tier its descendants go with it
//   (Drop, which counts them as orphans).
// - Eviction is leaf-first: the disk's policy holds only blocks without children, and so does
//   RAM's when there is no disk tier (evicting a prefix from the last tier would drop the
//   chains below it). With a disk tier, RAM evicts any block: it spills, its descendants stay.
// - A block evicted from RAM keeps its disk copy if it has one (the disk tier is inclusive:
//   promotion leaves it there), spills to disk if there is a disk tier, or is dropped.
// - The disk evicts for good (LRU).
// Keys name blocks (BlockStore: encoded block names; replay: trace hash ids); the policies see
// ids the ledger assigns. A child may be added before its parent (a store's index is read in key
// order at Open); the leaf rule holds whatever the order. Not thread-safe: the owner's lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "kvstore/eviction_policy.h"

namespace strata::kvstore {

// A store's tiers, fastest first (kNone: in none).
enum class Tier : uint8_t { kNone = 0, kRam = 1, kDisk = 2 };
inline const char* TierName(Tier t) {
  switch (t) {
    case Tier::kRam:
      return "ram";
    case Tier::kDisk:
      return "disk";
    default:
      return "none";
  }
}

// What becomes of a block RAM evicts.
enum class RamFate {
  kOnDisk,  // the disk tier holds a copy already: nothing to do
  kSpill,   // write it to the disk tier (then AddToDisk)
  kDrop,    // no tier below: the caller drops it (and its descendants)
};

template <typename Key, typename Payload>
class TierLedger {
 public:
  // The owner's fields (Payload: a store's bytes and where they are on disk) and the ledger's.
  // The ledger sets in_ram and on_disk; the owner reads them.
  struct Entry : Payload {
    Key parent{};
    bool has_parent = false;
    uint64_t id = 0;  // the policies' name for it
    uint64_t bytes = 0;
    bool in_ram = false;
    bool on_disk = false;
  };

  TierLedger(uint64_t ram_bytes, uint64_t disk_bytes, bool disk_tier, PolicyKind ram_policy)
      : ram_bytes_(ram_bytes),
        disk_bytes_(disk_bytes),
        disk_tier_(disk_tier),
        ram_kind_(ram_policy) {
    Clear();
  }

  // Forgets every entry (a store's index rebuilt at Open).
  void Clear() {
    entries_.clear();
    children_.clear();
    keys_.clear();
    ram_ = MakePolicy(ram_kind_, ram_bytes_);
    disk_ = MakePolicy(PolicyKind::kLru, disk_bytes_);
    ram_used_ = disk_used_ = ram_blocks_ = disk_blocks_ = 0;
  }

  Entry* Find(const Key& key) {
    auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : &it->second;
  }
  const Entry* Find(const Key& key) const {
    auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : &it->second;
  }
  bool Contains(const Key& key) const { return entries_.contains(key); }
  const absl::flat_hash_map<Key, Entry>& entries() const { return entries_; }
  absl::flat_hash_map<Key, Entry>& entries() { return entries_; }

  // A block entering the ledger, in no tier yet, under `parent` (null for a chain's first chunk).
  // The key must be new.
  Entry& Add(const Key& key, const Key* parent, uint64_t bytes) {
    Entry& e = entries_[key];
    e.id = next_id_++;
    e.bytes = bytes;
    e.has_parent = parent != nullptr;
    if (parent != nullptr) e.parent = *parent;
    keys_[e.id] = key;
    if (parent != nullptr) AddChild(*parent, key);
    return e;
  }

  bool HasChildren(const Key& key) const {
    auto it = children_.find(key);
    return it != children_.end() && !it->second.empty();
  }

  // Makes room in RAM for `incoming` more bytes, evicting what the RAM policy gives up (skipping
  // what `pinned(key)` says is in use). Each victim leaves RAM first, then `evicted(key, entry,
  // fate)` says what the caller must do with it; a caller that drops it calls Drop from there.
  // False when the victims ran out before `incoming` fit.
  template <typename Pinned, typename Evicted>
  bool EvictRam(uint64_t incoming, Pinned&& pinned, Evicted&& evicted) {
    while (ram_used_ + incoming > ram_bytes_) {
      const std::optional<uint64_t> victim =
          ram_->Victim([&](uint64_t id) { return pinned(keys_.at(id)); });
      if (!victim) return false;
      const Key key = keys_.at(*victim);
      Entry& e = entries_.at(key);
      ram_->Evict(*victim);
      e.in_ram = false;
      ram_used_ -= e.bytes;
      --ram_blocks_;
      evicted(key, e, e.on_disk ? RamFate::kOnDisk : disk_tier_ ? RamFate::kSpill : RamFate::kDrop);
    }
    return true;
  }

  // Into RAM (after EvictRam made room): the caller has its bytes.
  void AddToRam(const Key& key) {
    Entry& e = entries_.at(key);
    e.in_ram = true;
    if (InRamPolicy(key)) ram_->Insert(e.id, e.bytes);
    ram_used_ += e.bytes;
    ++ram_blocks_;
  }

  // Onto disk; then EvictDisk makes the tier fit again.
  void AddToDisk(const Key& key) {
    Entry& e = entries_.at(key);
    e.on_disk = true;
    if (!HasChildren(key)) disk_->Insert(e.id, e.bytes);
    disk_used_ += e.bytes;
    ++disk_blocks_;
  }

  // Evicts from disk until `incoming` more bytes fit or no leaf is left. Each victim leaves the
  // disk first, then `evicted(key, entry)`: the caller frees its bytes there, and drops it when
  // it is in no tier any more.
  template <typename Evicted>
  void EvictDisk(uint64_t incoming, Evicted&& evicted) {
    while (disk_used_ + incoming > disk_bytes_ && disk_->size() > 0) {
      const std::optional<uint64_t> victim = disk_->Victim([](uint64_t) { return false; });
      if (!victim) return;
      const Key key = keys_.at(*victim);
      Entry& e = entries_.at(key);
      disk_->Evict(*victim);
      e.on_disk = false;
      disk_used_ -= e.bytes;
      --disk_blocks_;
      evicted(key, e);
    }
  }

  void TouchRam(const Key& key) {
    if (const Entry* e = Find(key); e != nullptr && e->in_ram) ram_->Access(e->id);
  }
  void TouchDisk(const Key& key) {
    if (const Entry* e = Find(key); e != nullptr && e->on_disk) disk_->Access(e->id);
  }

  // Removes `root` from every tier and the ledger, and its descendants with it; `removed(key,
  // entry)` sees each (root first) before it goes, its tier flags still set. Returns how many
  // descendants went (orphans).
  template <typename Removed>
  uint64_t Drop(const Key& root, Removed&& removed) {
    std::vector<Key> stack = {root};
    uint64_t orphans = 0;
    bool first = true;
    while (!stack.empty()) {
      const Key key = std::move(stack.back());
      stack.pop_back();
      auto it = entries_.find(key);
      if (it == entries_.end()) continue;
      if (auto c = children_.find(key); c != children_.end()) {
        for (const Key& child : c->second) stack.push_back(child);
        children_.erase(c);
      }
      Entry& e = it->second;
      removed(key, e);
      if (e.in_ram) {
        ram_->Erase(e.id);
        ram_used_ -= e.bytes;
        --ram_blocks_;
      }
      if (e.on_disk) {
        disk_->Erase(e.id);
        disk_used_ -= e.bytes;
        --disk_blocks_;
      }
      const bool has_parent = e.has_parent;
      const Key parent = e.parent;
      keys_.erase(e.id);
      entries_.erase(it);
      if (has_parent) RemoveChild(parent, key);
      if (!first) ++orphans;
      first = false;
    }
    return orphans;
  }

  uint64_t ram_used() const { return ram_used_; }
  uint64_t disk_used() const { return disk_used_; }
  uint64_t ram_blocks() const { return ram_blocks_; }
  uint64_t disk_blocks() const { return disk_blocks_; }
  uint64_t ram_capacity() const { return ram_bytes_; }
  uint64_t disk_capacity() const { return disk_bytes_; }
  bool disk_tier() const { return disk_tier_; }

 private:
  // Without a disk tier, RAM's policy holds leaves only.
  bool InRamPolicy(const Key& key) const { return disk_tier_ || !HasChildren(key); }

  // A block that gains its first child leaves the policies that hold leaves only; when its last
  // child goes it comes back.
  void AddChild(const Key& parent, const Key& child) {
    auto& kids = children_[parent];
    const bool was_leaf = kids.empty();
    kids.insert(child);
    if (!was_leaf) return;
    const Entry* p = Find(parent);
    if (p == nullptr) return;  // arriving later (a store's index read in key order)
    if (p->in_ram && !disk_tier_) ram_->Erase(p->id);
    if (p->on_disk) disk_->Erase(p->id);
  }

  void RemoveChild(const Key& parent, const Key& child) {
    auto c = children_.find(parent);
    if (c == children_.end()) return;
    c->second.erase(child);
    if (!c->second.empty()) return;
    children_.erase(c);
    const Entry* p = Find(parent);
    if (p == nullptr) return;
    if (p->in_ram && !disk_tier_) ram_->Insert(p->id, p->bytes);
    if (p->on_disk) disk_->Insert(p->id, p->bytes);
  }

  const uint64_t ram_bytes_, disk_bytes_;
  const bool disk_tier_;
  const PolicyKind ram_kind_;
  std::unique_ptr<EvictionPolicy> ram_, disk_;
  absl::flat_hash_map<Key, Entry> entries_;
  absl::flat_hash_map<Key, absl::flat_hash_set<Key>> children_;
  absl::flat_hash_map<uint64_t, Key> keys_;  // policy id -> key
  uint64_t next_id_ = 1;
  uint64_t ram_used_ = 0, disk_used_ = 0, ram_blocks_ = 0, disk_blocks_ = 0;
};

}  // namespace strata::kvstore
