#include "kvstore/replay.h"

#include <fstream>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace strata::kvstore {

absl::StatusOr<std::vector<TraceRequest>> LoadMooncakeTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("trace: cannot read ", path));
  std::vector<TraceRequest> out;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("trace ", path, " line ", n, ": ", why));
    };
    if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
    TraceRequest r;
    if (!j.contains("input_length") || !j["input_length"].is_number_unsigned()) {
      return bad("input_length is missing or not a non-negative integer");
    }
    if (!j.contains("hash_ids") || !j["hash_ids"].is_array()) return bad("hash_ids is not a list");
    r.input_tokens = j["input_length"].get<uint32_t>();
    r.output_tokens = j.value("output_length", 0u);
    r.timestamp_ms = j.value("timestamp", 0.0);
    for (const auto& id : j["hash_ids"]) {
      if (!id.is_number_unsigned()) return bad("a hash id is not a non-negative integer");
      r.hash_ids.push_back(id.get<uint64_t>());
    }
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

class TierModel {
 public:
  explicit TierModel(const ReplayConfig& c)
      : c_(c), ram_(MakePolicy(c.ram_policy, c.ram_bytes)),
        disk_(MakePolicy(PolicyKind::kLru, c.disk_bytes)) {}

  // The tier holding `id`: 0 none, 1 RAM, 2 disk.
  int Where(uint64_t id) const {
    auto it = e_.find(id);
    if (it == e_.end()) return 0;
    return it->second.ram ? 1 : 2;
  }

  void Hit(uint64_t id, ReplayResult& r) {
    Entry& e = e_[id];
    if (e.ram) {
      if (InRamPolicy(id)) ram_->Access(id);
      r.bytes_read_ram += c_.chunk_bytes;
      return;
    }
    if (!HasChildren(id)) disk_->Access(id);
    r.bytes_read_disk += c_.chunk_bytes;
    ++r.promotions;
    InsertRam(id, r);  // the disk copy stays
  }

  // A newly prefilled chunk; false when its parent is gone (it could never be found).
  bool Put(uint64_t id, uint64_t parent, bool has_parent, ReplayResult& r) {
    if (e_.contains(id)) return true;
    if (has_parent && !e_.contains(parent)) return false;
    Entry& e = e_[id];
    e.parent = parent;
    e.has_parent = has_parent;
    if (has_parent) AddChild(parent, id);
    InsertRam(id, r);
    return e_.contains(id);
  }

 private:
  struct Entry {
    uint64_t parent = 0;
    bool has_parent = false;
    bool ram = false, disk = false;
  };

  // Eviction is leaf-first: the policies only hold entries that can go. Without a disk, a chunk
  // in RAM with descendants stays (evicting it would drop them); on disk the same always holds.
  bool HasChildren(uint64_t id) const {
    auto it = children_.find(id);
    return it != children_.end() && !it->second.empty();
  }
  bool InRamPolicy(uint64_t id) const { return c_.disk_bytes > 0 || !HasChildren(id); }

  void AddChild(uint64_t parent, uint64_t child) {
    auto& kids = children_[parent];
    const bool was_leaf = kids.empty();
    kids.insert(child);
    if (!was_leaf) return;
    const Entry& p = e_[parent];
    if (p.ram && c_.disk_bytes == 0) ram_->Erase(parent);
    if (p.disk) disk_->Erase(parent);
  }

  void RemoveChild(uint64_t parent, uint64_t child) {
    auto it = children_.find(parent);
    if (it == children_.end()) return;
    it->second.erase(child);
    if (!it->second.empty()) return;
    children_.erase(it);
    auto pe = e_.find(parent);
    if (pe == e_.end()) return;
    if (pe->second.ram && c_.disk_bytes == 0) ram_->Insert(parent, c_.chunk_bytes);
    if (pe->second.disk) disk_->Insert(parent, c_.chunk_bytes);
  }

  void InsertRam(uint64_t id, ReplayResult& r) {
    const bool fits = c_.chunk_bytes <= c_.ram_bytes;
    while (fits && ram_used_ + c_.chunk_bytes > c_.ram_bytes) {
      auto v = ram_->Victim([](uint64_t) { return false; });
      if (!v) break;
      ram_->Evict(*v);
      ram_used_ -= c_.chunk_bytes;
      ++r.ram_evictions;
      Entry& ve = e_[*v];
      ve.ram = false;
      if (ve.disk) continue;
      if (c_.disk_bytes >= c_.chunk_bytes) {
        ToDisk(*v, r);
      } else {
        Drop(*v, r);
      }
    }
    auto it = e_.find(id);
    if (it == e_.end()) return;  // dropped meanwhile
    if (!fits || ram_used_ + c_.chunk_bytes > c_.ram_bytes) {  // RAM cannot take it
      if (!it->second.disk && c_.disk_bytes >= c_.chunk_bytes) ToDisk(id, r);
      if (e_.contains(id) && !e_[id].disk) Drop(id, r);
      return;
    }
    it->second.ram = true;
    if (InRamPolicy(id)) ram_->Insert(id, c_.chunk_bytes);
    ram_used_ += c_.chunk_bytes;
  }

  void ToDisk(uint64_t id, ReplayResult& r) {
    while (disk_used_ + c_.chunk_bytes > c_.disk_bytes) {
      auto v = disk_->Victim([](uint64_t) { return false; });
      if (!v) return;
      disk_->Evict(*v);
      disk_used_ -= c_.chunk_bytes;
      ++r.disk_evictions;
      e_[*v].disk = false;
      if (!e_[*v].ram) Drop(*v, r);
    }
    if (!e_.contains(id)) return;
    e_[id].disk = true;
    if (!HasChildren(id)) disk_->Insert(id, c_.chunk_bytes);
    disk_used_ += c_.chunk_bytes;
    r.bytes_written_disk += c_.chunk_bytes;
  }

  // Removes `root` from every tier, and its descendants (counted as orphans).
  void Drop(uint64_t root, ReplayResult& r) {
    std::vector<uint64_t> stack = {root};
    bool first = true;
    while (!stack.empty()) {
      const uint64_t id = stack.back();
      stack.pop_back();
      auto it = e_.find(id);
      if (it == e_.end()) continue;
      if (auto ch = children_.find(id); ch != children_.end()) {
        for (uint64_t c : ch->second) stack.push_back(c);
        children_.erase(ch);
      }
      if (it->second.ram) {
        ram_->Erase(id);
        ram_used_ -= c_.chunk_bytes;
      }
      if (it->second.disk) {
        disk_->Erase(id);
        disk_used_ -= c_.chunk_bytes;
      }
      const bool has_parent = it->second.has_parent;
      const uint64_t parent = it->second.parent;
      e_.erase(it);
      if (has_parent) RemoveChild(parent, id);
      if (!first) ++r.orphans_dropped;
      first = false;
    }
  }

  const ReplayConfig c_;
  std::unique_ptr<EvictionPolicy> ram_, disk_;
  uint64_t ram_used_ = 0, disk_used_ = 0;
  absl::flat_hash_map<uint64_t, Entry> e_;
  absl::flat_hash_map<uint64_t, absl::flat_hash_set<uint64_t>> children_;
};

}  // namespace

ReplayResult Replay(const std::vector<TraceRequest>& trace, const ReplayConfig& config) {
  ReplayResult r;
  TierModel m(config);
  for (const TraceRequest& q : trace) {
    ++r.requests;
    // Only whole chunks are shared; the prompt's last partial block never is.
    const size_t full = std::min<size_t>(q.hash_ids.size(), q.input_tokens / config.block_tokens);
    r.chunks_requested += full;
    r.tokens_requested += q.input_tokens;
    size_t hits = 0;
    for (; hits < full; ++hits) {
      const int where = m.Where(q.hash_ids[hits]);
      if (where == 0) break;
      (where == 1 ? r.chunk_hits_ram : r.chunk_hits_disk)++;
      m.Hit(q.hash_ids[hits], r);
    }
    r.tokens_saved += hits * config.block_tokens;
    for (size_t i = hits; i < full; ++i) {
      if (!m.Put(q.hash_ids[i], i > 0 ? q.hash_ids[i - 1] : 0, i > 0, r)) break;
    }
  }
  return r;
}

}  // namespace strata::kvstore
