#include "router/prefix_index.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace strata::router {
namespace {

constexpr uint8_t TierBit(HolderTier tier) { return uint8_t{1} << static_cast<int>(tier); }

bool ValidTier(HolderTier tier) { return static_cast<int>(tier) < kNumHolderTiers; }

bool ValidType(EventType type) {
  return type == EventType::kStored || type == EventType::kRemoved || type == EventType::kCleared;
}

}  // namespace

const char* HolderTierName(HolderTier tier) {
  switch (tier) {
    case HolderTier::kDevice:
      return "device";
    case HolderTier::kRam:
      return "ram";
    case HolderTier::kDisk:
      return "disk";
  }
  return "invalid";
}

const char* HolderKindName(HolderKind kind) {
  switch (kind) {
    case HolderKind::kNode:
      return "node";
    case HolderKind::kStore:
      return "store";
  }
  return "invalid";
}

const char* EventOutcomeName(EventOutcome outcome) {
  switch (outcome) {
    case EventOutcome::kStale:
      return "stale";
    case EventOutcome::kContiguous:
      return "contiguous";
    case EventOutcome::kGap:
      return "gap";
    case EventOutcome::kAwaitingSnapshot:
      return "awaiting_snapshot";
  }
  return "invalid";
}

absl::Status PrefixIndexOptions::Validate() const {
  if (prediction_ttl < absl::ZeroDuration() || prediction_ttl == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("prediction_ttl must be finite and >= 0");
  }
  if (max_entries == 0) return absl::InvalidArgumentError("max_entries must be >= 1");
  return absl::OkStatus();
}

const HolderOverlap* OverlapResult::Find(absl::string_view holder_id) const {
  for (const HolderOverlap& h : holders) {
    if (h.holder_id == holder_id) return &h;
  }
  return nullptr;
}

uint32_t OverlapResult::StoreChunks() const {
  uint32_t best = 0;
  for (const HolderOverlap& h : holders) {
    if (h.kind == HolderKind::kStore) best = std::max(best, h.chunks);
  }
  return best;
}

size_t PrefixIndex::KeyHash::operator()(const BlockHash& key) const {
  uint64_t v;
  std::memcpy(&v, key.data(), sizeof(v));
  return absl::Hash<uint64_t>{}(v);
}

PrefixIndex::PrefixIndex(PrefixIndexOptions options)
    : options_(std::move(options)),
      all_tier_bits_(TierBit(HolderTier::kDevice) | TierBit(HolderTier::kRam) |
                     TierBit(HolderTier::kDisk)) {
  STRATA_CHECK(options_.Validate().ok(), "invalid PrefixIndexOptions; use PrefixIndex::Create");
}

absl::StatusOr<std::unique_ptr<PrefixIndex>> PrefixIndex::Create(PrefixIndexOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::make_unique<PrefixIndex>(std::move(options));
}

absl::StatusOr<uint32_t> PrefixIndex::FindSlot(absl::string_view holder_id) const {
  auto it = slot_by_id_.find(holder_id);
  if (it == slot_by_id_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown holder '", holder_id, "'"));
  }
  return it->second;
}

absl::Status PrefixIndex::RegisterHolder(const HolderInfo& info, uint64_t incarnation) {
  if (info.id.empty()) return absl::InvalidArgumentError("holder id is empty");
  std::unique_lock lock(mu_);
  auto it = slot_by_id_.find(info.id);
  if (it != slot_by_id_.end()) {
    if (!AdoptIncarnation(it->second, incarnation)) {
      return absl::FailedPreconditionError(
          absl::StrCat("holder '", info.id, "' re-registered with incarnation ", incarnation, " < ",
                       holders_[it->second].incarnation));
    }
    holders_[it->second].info.kind = info.kind;
    return absl::OkStatus();
  }
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(holders_.size());
    holders_.emplace_back();
  }
  Holder& h = holders_[slot];
  h.info = info;
  h.live = true;
  h.incarnation = incarnation;
  h.cursor = 0;
  h.awaiting_snapshot = false;
  slot_by_id_.emplace(info.id, slot);
  return absl::OkStatus();
}

absl::Status PrefixIndex::RemoveHolder(absl::string_view holder_id) {
  std::unique_lock lock(mu_);
  auto it = slot_by_id_.find(holder_id);
  if (it == slot_by_id_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown holder '", holder_id, "'"));
  }
  const uint32_t slot = it->second;
  ClearHolder(slot, all_tier_bits_ | kPredictedBit);
  slot_by_id_.erase(it);
  holders_[slot] = Holder{};
  free_slots_.push_back(slot);
  return absl::OkStatus();
}

bool PrefixIndex::AdoptIncarnation(uint32_t slot, uint64_t incarnation) {
  Holder& h = holders_[slot];
  if (incarnation < h.incarnation) return false;
  if (incarnation > h.incarnation) {
    // A restarted holder lost its cache; the router's predictions for it are void too.
    ClearHolder(slot, all_tier_bits_ | kPredictedBit);
    h.incarnation = incarnation;
    h.cursor = 0;
    h.awaiting_snapshot = false;
    h.buffer.clear();
    ++counters_.restarts;
  }
  return true;
}

absl::StatusOr<EventOutcome> PrefixIndex::Apply(absl::string_view holder_id,
                                                const HolderEvent& event) {
  if (event.event_id == 0) return absl::InvalidArgumentError("event_id must be >= 1");
  if (!ValidType(event.type) || !ValidTier(event.tier)) {
    return absl::InvalidArgumentError("event with an invalid type or tier");
  }
  std::unique_lock lock(mu_);
  absl::StatusOr<uint32_t> slot = FindSlot(holder_id);
  if (!slot.ok()) return slot.status();
  if (!AdoptIncarnation(*slot, event.incarnation)) {
    ++counters_.events_stale;
    return EventOutcome::kStale;
  }
  return ApplyOrdered(*slot, event);
}

EventOutcome PrefixIndex::ApplyOrdered(uint32_t slot, const HolderEvent& event) {
  Holder& h = holders_[slot];
  if (h.awaiting_snapshot) {
    if (h.buffer.size() < options_.max_buffered_events) h.buffer.push_back(event);
    return EventOutcome::kAwaitingSnapshot;
  }
  if (event.event_id <= h.cursor) {
    ++counters_.events_stale;
    return EventOutcome::kStale;
  }
  if (event.event_id > h.cursor + 1) {
    // Splicing the missing range is not attempted: the holder's current state (a snapshot) is
    // simpler and always right, which is where Dynamo's design ended up too.
    ClearHolder(slot, all_tier_bits_);
    h.awaiting_snapshot = true;
    h.buffer.clear();
    if (options_.max_buffered_events > 0) h.buffer.push_back(event);
    ++counters_.gaps;
    return EventOutcome::kGap;
  }
  ApplyBody(slot, event);
  h.cursor = event.event_id;
  ++counters_.events_applied;
  return EventOutcome::kContiguous;
}

void PrefixIndex::ApplyBody(uint32_t slot, const HolderEvent& event) {
  switch (event.type) {
    case EventType::kStored:
      for (const BlockHash& key : event.keys) AddTier(slot, key, event.tier);
      break;
    case EventType::kRemoved:
      for (const BlockHash& key : event.keys) {
        ClearBits(slot, key, TierBit(event.tier) | kPredictedBit);
      }
      break;
    case EventType::kCleared:
      ClearHolder(slot, all_tier_bits_ | kPredictedBit);
      break;
  }
}

absl::StatusOr<EventOutcome> PrefixIndex::ApplySnapshot(absl::string_view holder_id,
                                                        uint64_t incarnation,
                                                        uint64_t as_of_event_id,
                                                        absl::Span<const SnapshotBlock> blocks) {
  for (const SnapshotBlock& b : blocks) {
    if (!ValidTier(b.tier)) return absl::InvalidArgumentError("snapshot block with invalid tier");
  }
  std::unique_lock lock(mu_);
  absl::StatusOr<uint32_t> slot = FindSlot(holder_id);
  if (!slot.ok()) return slot.status();
  if (!AdoptIncarnation(*slot, incarnation)) return EventOutcome::kStale;
  Holder& h = holders_[*slot];
  if (!h.awaiting_snapshot && as_of_event_id < h.cursor) return EventOutcome::kStale;
  ClearHolder(*slot, all_tier_bits_);
  for (const SnapshotBlock& b : blocks) AddTier(*slot, b.key, b.tier);
  h.cursor = as_of_event_id;
  h.awaiting_snapshot = false;
  ++counters_.snapshots;
  return ReplayBuffer(*slot);
}

EventOutcome PrefixIndex::ReplayBuffer(uint32_t slot) {
  std::deque<HolderEvent> buffered = std::move(holders_[slot].buffer);
  holders_[slot].buffer.clear();
  EventOutcome outcome = EventOutcome::kContiguous;
  for (const HolderEvent& e : buffered) {
    // Events the snapshot already covers come back kStale and are skipped; after a hole the
    // rest is buffered again for the next snapshot.
    if (ApplyOrdered(slot, e) == EventOutcome::kGap) outcome = EventOutcome::kGap;
  }
  return outcome;
}

bool PrefixIndex::ReserveEntry() {
  if (entries_ < options_.max_entries) return true;
  return TrimPredictions(absl::InfinitePast(), /*evict_one=*/true) > 0;
}

void PrefixIndex::AddTier(uint32_t slot, const BlockHash& key, HolderTier tier) {
  auto it = map_.find(key);
  if (it != map_.end()) {
    for (Holding& holding : it->second) {
      if (holding.slot != slot) continue;
      if (holding.bits & kPredictedBit) {
        // The event is the truth the prediction stood in for.
        holding.bits &= static_cast<uint8_t>(~kPredictedBit);
        holding.prediction = 0;
        --live_predictions_;
      }
      holding.bits |= TierBit(tier);
      return;
    }
  }
  if (!ReserveEntry()) {
    ++counters_.refused_entries;
    return;
  }
  // ReserveEntry may have erased entries: look the key up again.
  Holding holding;
  holding.slot = slot;
  holding.bits = TierBit(tier);
  map_[key].push_back(holding);
  holders_[slot].keys.insert(key);
  ++entries_;
}

void PrefixIndex::AddPrediction(uint32_t slot, const BlockHash& key, absl::Time expires) {
  Holding* existing = nullptr;
  auto it = map_.find(key);
  if (it != map_.end()) {
    for (Holding& holding : it->second) {
      if (holding.slot == slot) existing = &holding;
    }
  }
  if (existing != nullptr && (existing->bits & all_tier_bits_)) return;  // events know better
  if (existing == nullptr) {
    if (!ReserveEntry()) return;
    Holding holding;
    holding.slot = slot;
    HoldingList& list = map_[key];
    list.push_back(holding);
    existing = &list.back();
    holders_[slot].keys.insert(key);
    ++entries_;
    ++live_predictions_;
  }
  existing->bits = kPredictedBit;
  existing->prediction = next_stamp_++;
  existing->expires = expires;
  predictions_.push_back(PredictionRecord{key, slot, existing->prediction, expires});
}

void PrefixIndex::ClearBits(uint32_t slot, const BlockHash& key, uint8_t clear_bits) {
  auto it = map_.find(key);
  if (it == map_.end()) return;
  HoldingList& list = it->second;
  for (size_t i = 0; i < list.size(); ++i) {
    Holding& holding = list[i];
    if (holding.slot != slot) continue;
    if ((holding.bits & kPredictedBit) && (clear_bits & kPredictedBit)) {
      holding.prediction = 0;
      --live_predictions_;
    }
    holding.bits &= static_cast<uint8_t>(~clear_bits);
    if (holding.bits == 0) {
      if (i + 1 != list.size()) list[i] = list.back();
      list.pop_back();
      --entries_;
      holders_[slot].keys.erase(key);
      if (list.empty()) map_.erase(it);
    }
    return;
  }
}

void PrefixIndex::ClearHolder(uint32_t slot, uint8_t clear_bits) {
  // ClearBits edits the set: walk a copy.
  std::vector<BlockHash> keys(holders_[slot].keys.begin(), holders_[slot].keys.end());
  for (const BlockHash& key : keys) ClearBits(slot, key, clear_bits);
}

bool PrefixIndex::RecordIsLive(const PredictionRecord& record) const {
  auto it = map_.find(record.key);
  if (it == map_.end()) return false;
  for (const Holding& holding : it->second) {
    if (holding.slot == record.slot) {
      return (holding.bits & kPredictedBit) && holding.prediction == record.stamp;
    }
  }
  return false;
}

size_t PrefixIndex::TrimPredictions(absl::Time now, bool evict_one) {
  size_t freed = 0;
  while (!predictions_.empty()) {
    const PredictionRecord record = predictions_.front();
    if (!RecordIsLive(record)) {
      predictions_.pop_front();
      continue;
    }
    if (record.expires <= now) {
      ++counters_.predictions_expired;
    } else if (evict_one && freed == 0) {
      ++counters_.predictions_evicted;
    } else {
      break;
    }
    predictions_.pop_front();
    ClearBits(record.slot, record.key, kPredictedBit);
    ++freed;
  }
  return freed;
}

void PrefixIndex::CompactPredictionQueue() {
  // Refreshing a prediction leaves its old record behind; keep the dead ones from piling up
  // under a hot prefix that is re-predicted many times per TTL.
  if (predictions_.size() <= 2 * live_predictions_ + 1024) return;
  std::deque<PredictionRecord> live;
  for (const PredictionRecord& r : predictions_) {
    if (RecordIsLive(r)) live.push_back(r);
  }
  predictions_ = std::move(live);
}

absl::Status PrefixIndex::Predict(absl::string_view holder_id, absl::Span<const BlockHash> chain,
                                  absl::Time now) {
  std::unique_lock lock(mu_);
  absl::StatusOr<uint32_t> slot = FindSlot(holder_id);
  if (!slot.ok()) return slot.status();
  if (options_.prediction_ttl == absl::ZeroDuration()) return absl::OkStatus();
  TrimPredictions(now, /*evict_one=*/false);
  const absl::Time expires = now + options_.prediction_ttl;
  for (const BlockHash& key : chain) AddPrediction(*slot, key, expires);
  CompactPredictionQueue();
  return absl::OkStatus();
}

size_t PrefixIndex::Sweep(absl::Time now) {
  std::unique_lock lock(mu_);
  const size_t freed = TrimPredictions(now, /*evict_one=*/false);
  CompactPredictionQueue();
  return freed;
}

OverlapResult PrefixIndex::Overlap(absl::Span<const BlockHash> chain, absl::Time now) const {
  struct Run {
    uint32_t chunks = 0;
    uint32_t tiers[kNumHolderTiers] = {0, 0, 0};
    uint32_t predicted = 0;
  };
  OverlapResult result;
  result.chain_chunks = static_cast<uint32_t>(chain.size());
  std::shared_lock lock(mu_);
  std::vector<Run> runs(holders_.size());
  for (uint32_t i = 0; i < chain.size(); ++i) {
    auto it = map_.find(chain[i]);
    if (it == map_.end()) break;
    bool extended = false;
    for (const Holding& holding : it->second) {
      Run& run = runs[holding.slot];
      if (run.chunks != i) continue;  // this holder already missed an earlier chunk
      int tier;
      if (holding.bits & kPredictedBit) {
        if (holding.expires <= now) continue;
        tier = static_cast<int>(HolderTier::kDevice);
        ++run.predicted;
      } else {
        tier = __builtin_ctz(holding.bits & all_tier_bits_);
      }
      ++run.tiers[tier];
      run.chunks = i + 1;
      extended = true;
    }
    if (!extended) break;
  }
  for (uint32_t slot = 0; slot < runs.size(); ++slot) {
    const Run& run = runs[slot];
    if (run.chunks == 0) continue;
    HolderOverlap& h = result.holders.emplace_back();
    h.holder_id = holders_[slot].info.id;
    h.kind = holders_[slot].info.kind;
    h.chunks = run.chunks;
    std::copy(std::begin(run.tiers), std::end(run.tiers), std::begin(h.tier_chunks));
    h.predicted_chunks = run.predicted;
  }
  return result;
}

absl::StatusOr<HolderState> PrefixIndex::GetHolderState(absl::string_view holder_id) const {
  std::shared_lock lock(mu_);
  absl::StatusOr<uint32_t> slot = FindSlot(holder_id);
  if (!slot.ok()) return slot.status();
  const Holder& h = holders_[*slot];
  HolderState state;
  state.info = h.info;
  state.incarnation = h.incarnation;
  state.cursor = h.cursor;
  state.awaiting_snapshot = h.awaiting_snapshot;
  state.buffered_events = h.buffer.size();
  state.entries = h.keys.size();
  return state;
}

PrefixIndexStats PrefixIndex::Stats() const {
  std::shared_lock lock(mu_);
  PrefixIndexStats stats = counters_;
  stats.holders = slot_by_id_.size();
  stats.keys = map_.size();
  stats.entries = entries_;
  stats.predicted_entries = live_predictions_;
  return stats;
}

}  // namespace strata::router
