#include "kvstore/replay.h"

#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kvstore/tier_ledger.h"
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

// The store's tiers over sizes alone: BlockStore's own ledger (tier_ledger.h), driven in the
// order BlockStore drives it (a Put written through to disk first when puts are durable, then
// into RAM; a RAM victim spilled, kept or dropped as the ledger says; the disk trimmed after each
// block it takes; a disk hit promoted to RAM, its disk copy kept).
class TierModel {
 public:
  explicit TierModel(const ReplayConfig& c)
      : c_(c), ledger_(c.ram_bytes, c.disk_bytes, c.disk_bytes > 0, c.ram_policy) {}

  // The tier holding `id`: 0 none, 1 RAM, 2 disk.
  int Where(uint64_t id) const {
    const auto* e = ledger_.Find(id);
    if (e == nullptr) return 0;
    return e->in_ram ? 1 : 2;
  }

  void Hit(uint64_t id, ReplayResult& r) {
    if (ledger_.Find(id)->in_ram) {
      ledger_.TouchRam(id);
      r.bytes_read_ram += c_.chunk_bytes;
      return;
    }
    ledger_.TouchDisk(id);
    r.bytes_read_disk += c_.chunk_bytes;
    if (InsertRam(id, r)) ++r.promotions;  // the disk copy stays
  }

  // A newly prefilled chunk; false when its parent is gone (it could never be found).
  bool Put(uint64_t id, uint64_t parent, bool has_parent, ReplayResult& r) {
    if (ledger_.Contains(id)) return true;
    if (has_parent && !ledger_.Contains(parent)) return false;
    ledger_.Add(id, has_parent ? &parent : nullptr, c_.chunk_bytes);
    if (c_.durable_puts && ledger_.disk_tier()) {
      WriteToDisk(id, r);
      if (!ledger_.Contains(id)) return false;  // larger than the disk tier
    }
    if (!InsertRam(id, r) && !ledger_.Find(id)->on_disk) {
      if (ledger_.disk_tier()) {
        WriteToDisk(id, r);  // RAM cannot take it: straight to disk
      } else {
        Drop(id, r);
      }
    }
    return ledger_.Contains(id);
  }

 private:
  // False when RAM cannot take it (smaller than a block, or full of prefixes of resident blocks).
  bool InsertRam(uint64_t id, ReplayResult& r) {
    if (c_.chunk_bytes > c_.ram_bytes) return false;
    const bool room = ledger_.EvictRam(
        c_.chunk_bytes, [](uint64_t) { return false; },
        [&](uint64_t victim, const Ledger::Entry&, RamFate fate) {
          ++r.ram_evictions;
          if (fate == RamFate::kSpill) WriteToDisk(victim, r);
          if (fate == RamFate::kDrop) Drop(victim, r);
        });
    if (!room || !ledger_.Contains(id)) return false;
    ledger_.AddToRam(id);
    return true;
  }

  void WriteToDisk(uint64_t id, ReplayResult& r) {
    ledger_.AddToDisk(id);
    r.bytes_written_disk += c_.chunk_bytes;
    ledger_.EvictDisk(0, [&](uint64_t victim, const Ledger::Entry& e) {
      ++r.disk_evictions;
      if (!e.in_ram) Drop(victim, r);  // in no tier any more
    });
  }

  void Drop(uint64_t id, ReplayResult& r) {
    r.orphans_dropped += ledger_.Drop(id, [](uint64_t, const Ledger::Entry&) {});
  }

  struct NoBytes {};
  using Ledger = TierLedger<uint64_t, NoBytes>;
  const ReplayConfig c_;
  Ledger ledger_;
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
