// PrefixIndex: the router's view of which holder has which chunk of which prefix.
//
// A holder is a prefill node's local cache, a decode node, or the shared block store. It is
// registered under an id with a kind and an incarnation, and then fed the events it publishes:
//
//   PrefixIndex index(PrefixIndexOptions{});
//   index.RegisterHolder({.id = "p0", .kind = HolderKind::kNode}, /*incarnation=*/1);
//   index.Apply("p0", {.incarnation = 1, .event_id = 1, .type = EventType::kStored,
//                      .keys = {k0, k1}});
//   OverlapResult o = index.Overlap(chain, now);    // leading chunks per holder
//   index.Predict("p0", chain, now);                // after routing a request to p0
//
// Keys are chunk keys (common/prefix_key.h, PrefixHasher::ChunkKeys): a chunk is published as
// Stored only once all its layers are committed at that tier, so a present key means a usable
// chunk.
//
// Tiers: one holder has one event stream (one monotonic event_id) whatever its tiers, as in
// Dynamo, where the storage tier rides beside the per-worker event id. So the tier is carried by
// each Stored/Removed event and recorded per (key, holder); a key may sit in several tiers of
// one holder at once. A deployment that runs one stream per tier registers one holder per tier.
//
// Event ordering, per holder (Dynamo's recovery design):
// - An event of an older incarnation is kStale. A newer incarnation means the holder restarted:
//   its entries are dropped and its cursor reset to 0 before the event is considered.
// - event_id <= cursor: kStale, dropped. event_id == cursor + 1: applied, kContiguous.
//   event_id > cursor + 1: kGap. The holder's event-fed entries are discarded, the caller must
//   fetch a snapshot (ApplySnapshot), and until it arrives later events are buffered (at most
//   max_buffered_events; the rest are dropped) and answered kAwaitingSnapshot. The snapshot's
//   entries replace the holder's; buffered events newer than its as_of_event_id are then
//   replayed in order (a hole among them is a new kGap).
// - A newly registered holder starts at cursor 0, as a freshly started holder does; a router
//   that discovers a holder already running sees its first event as a kGap and resyncs.
// - kCleared removes every entry of the holder (all tiers) and its predictions: a barrier.
//
// Predictions: Predict() marks a chain as held by a node for `prediction_ttl`, so that the
// next turn of a conversation routes to the same node before that node's events arrive (Dynamo's
// router_predicted_ttl_secs, SGLang's insert-on-route). A predicted chunk counts as device-tier.
// Any event naming the key at that holder (Stored, Removed), kCleared, a snapshot holding the key,
// a restart or RemoveHolder supersedes the prediction; a gap keeps predictions (they record the
// router's own decisions, which no lost event can contradict) and they expire as usual. Expired
// predictions are ignored by Overlap at once and freed by the next write (Predict, Sweep) that
// reaches them; Sweep(now) is meant to run periodically.
//
// Memory: at most max_entries (key, holder) entries, predicted or event-fed. Over the cap, the
// least recently predicted predictions are evicted first; when no prediction is left, a Stored
// entry is refused (counted in Stats().refused_entries). Refusing the newest keeps the index a
// subset of the truth: the holder's own Removed events later free room, whereas evicting
// event-fed entries would hide chunks the holder still has with no event ever restoring them.
//
// Thread safety: all methods are thread-safe. Overlap and the read-only accessors take a shared
// lock; everything else an exclusive one (one std::shared_mutex for the whole index).
//
// Complexity (H holders, n chain length): Overlap is one hash lookup per key plus the holders
// listed for it, and stops at the first key no holder still in the running has; so at most
// n lookups and O(n * H) work. Apply and Predict are O(keys). Removing all of a holder's
// entries (gap, Cleared, snapshot, restart, RemoveHolder) is O(that holder's keys).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/prefix_key.h"

namespace strata::router {

// Ordered fastest first: where a key is in several tiers, the lowest value counts.
enum class HolderTier : uint8_t { kDevice = 0, kRam = 1, kDisk = 2 };
inline constexpr int kNumHolderTiers = 3;
const char* HolderTierName(HolderTier tier);

enum class HolderKind : uint8_t {
  kNode,   // a prefill or decode node's own cache; readable by that node only
  kStore,  // the shared block store; readable by every prefill node
};
const char* HolderKindName(HolderKind kind);

struct HolderInfo {
  std::string id;  // unique; for nodes the node id the routing policy sees (NodeLoad::id)
  HolderKind kind = HolderKind::kNode;
};

enum class EventType : uint8_t { kStored, kRemoved, kCleared };

struct HolderEvent {
  uint64_t incarnation = 0;  // the holder's life; grows when it restarts
  uint64_t event_id = 0;     // >= 1; +1 per event within one incarnation
  EventType type = EventType::kStored;
  HolderTier tier = HolderTier::kDevice;  // kStored, kRemoved: the tier the keys entered / left
  std::vector<BlockHash> keys;            // kStored, kRemoved; ignored for kCleared
};

struct SnapshotBlock {
  BlockHash key{};
  HolderTier tier = HolderTier::kDevice;
};

enum class EventOutcome : uint8_t {
  kStale,             // older than the holder's cursor or incarnation: dropped
  kContiguous,        // applied
  kGap,               // events were missed: entries discarded, the caller must send a snapshot
  kAwaitingSnapshot,  // a snapshot is pending: the event was buffered (or dropped if full)
};
const char* EventOutcomeName(EventOutcome outcome);

struct PrefixIndexOptions {
  // How long a prediction (Predict) counts. Dynamo's router_predicted_ttl_secs default.
  absl::Duration prediction_ttl = absl::Seconds(120);
  // Cap on (key, holder) entries, predicted and event-fed together. >= 1.
  size_t max_entries = size_t{1} << 24;
  // Events kept per holder while a snapshot is awaited, replayed after it (Dynamo buffers 1024).
  size_t max_buffered_events = 1024;

  absl::Status Validate() const;
};

// How much of one chain one holder has.
struct HolderOverlap {
  std::string holder_id;
  HolderKind kind = HolderKind::kNode;
  // Leading chunks present: chunk i counts only when chunks 0..i are all present (any tier, or
  // an unexpired prediction).
  uint32_t chunks = 0;
  // `chunks` split by the fastest tier each chunk is in; they sum to `chunks`.
  uint32_t tier_chunks[kNumHolderTiers] = {0, 0, 0};
  // Of tier_chunks[kDevice], those known only from a prediction.
  uint32_t predicted_chunks = 0;

  uint32_t device_chunks() const { return tier_chunks[0]; }
  uint32_t ram_chunks() const { return tier_chunks[1]; }
  uint32_t disk_chunks() const { return tier_chunks[2]; }
};

struct OverlapResult {
  uint32_t chain_chunks = 0;           // length of the queried chain
  std::vector<HolderOverlap> holders;  // holders with chunks > 0, in no particular order

  // The entry for `holder_id`, or nullptr (no leading chunk there).
  const HolderOverlap* Find(absl::string_view holder_id) const;
  // The longest leading overlap among kStore holders (0 if none).
  uint32_t StoreChunks() const;
};

// One holder's bookkeeping, for tests, logs and the router's status page.
struct HolderState {
  HolderInfo info;
  uint64_t incarnation = 0;
  uint64_t cursor = 0;  // last applied event id
  bool awaiting_snapshot = false;
  size_t buffered_events = 0;
  size_t entries = 0;  // keys with an event-fed or predicted entry
};

struct PrefixIndexStats {
  size_t holders = 0;
  size_t keys = 0;               // distinct keys held anywhere
  size_t entries = 0;            // (key, holder) pairs, predicted included
  size_t predicted_entries = 0;  // including expired ones not yet swept
  uint64_t events_applied = 0, events_stale = 0, gaps = 0, snapshots = 0, restarts = 0;
  uint64_t refused_entries = 0;      // Stored keys refused at max_entries
  uint64_t predictions_evicted = 0;  // evicted for room before expiry
  uint64_t predictions_expired = 0;
};

class PrefixIndex {
 public:
  // Options must be valid (CHECKed): use Create for options from outside.
  explicit PrefixIndex(PrefixIndexOptions options);
  // kInvalidArgument when options.Validate() fails.
  static absl::StatusOr<std::unique_ptr<PrefixIndex>> Create(PrefixIndexOptions options);

  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // Adds a holder, or re-registers a known one. A higher incarnation than known drops its
  // entries and resets its cursor (a restart); the same one only updates the kind; a lower one
  // is refused (kFailedPrecondition). kInvalidArgument for an empty id.
  absl::Status RegisterHolder(const HolderInfo& info, uint64_t incarnation);
  // Forgets a holder and all its entries (left the cluster, failed, lease expired).
  // kNotFound if unknown.
  absl::Status RemoveHolder(absl::string_view holder_id);

  // Applies one event of `holder_id` (see the ordering rules above). kNotFound for an
  // unregistered holder, kInvalidArgument for event_id 0.
  absl::StatusOr<EventOutcome> Apply(absl::string_view holder_id, const HolderEvent& event);

  // Replaces the holder's event-fed entries with `blocks`, as of `as_of_event_id` (the id of
  // the last event the snapshot reflects; 0 for none), then replays buffered events. Returns
  // kStale (and changes nothing) for an older incarnation or, when no snapshot is awaited, for
  // as_of_event_id < cursor; kGap when the replay finds a hole (a new snapshot is needed);
  // otherwise kContiguous. A newer incarnation is a restart first. Errors as Apply.
  absl::StatusOr<EventOutcome> ApplySnapshot(absl::string_view holder_id, uint64_t incarnation,
                                             uint64_t as_of_event_id,
                                             absl::Span<const SnapshotBlock> blocks);

  // Marks `chain` as held (device tier) by `holder_id` until now + prediction_ttl; refreshes
  // existing predictions; keys the holder already has from events are left as they are.
  // kNotFound for an unknown holder.
  absl::Status Predict(absl::string_view holder_id, absl::Span<const BlockHash> chain,
                       absl::Time now);

  // Leading overlap of `chain` with every holder; predictions expiring at or before `now` do
  // not count.
  OverlapResult Overlap(absl::Span<const BlockHash> chain, absl::Time now) const;

  // Frees every prediction that expired at or before `now`. Returns how many.
  size_t Sweep(absl::Time now);

  // kNotFound if unknown.
  absl::StatusOr<HolderState> GetHolderState(absl::string_view holder_id) const;
  PrefixIndexStats Stats() const;
  const PrefixIndexOptions& options() const { return options_; }

 private:
  // SHA-256 digests are uniform already; hash 8 of their bytes through absl's seeded mix.
  struct KeyHash {
    size_t operator()(const BlockHash& key) const;
  };

  static constexpr uint8_t kPredictedBit = 1u << 7;  // beside the tier bits 1 << HolderTier

  // One holder's claim on one key: tier bits and/or kPredictedBit.
  struct Holding {
    uint32_t slot = 0;  // index into holders_
    uint8_t bits = 0;
    uint64_t prediction = 0;  // with kPredictedBit: the stamp of its live PredictionRecord
    absl::Time expires;       // with kPredictedBit
  };
  using HoldingList = absl::InlinedVector<Holding, 2>;

  // Predictions in the order they were made or refreshed (and so of expiry: one TTL for all).
  // A record is live while its holding still carries its stamp.
  struct PredictionRecord {
    BlockHash key;
    uint32_t slot;
    uint64_t stamp;
    absl::Time expires;
  };

  struct Holder {
    HolderInfo info;
    bool live = false;  // false: a freed slot
    uint64_t incarnation = 0;
    uint64_t cursor = 0;
    bool awaiting_snapshot = false;
    std::deque<HolderEvent> buffer;  // events while awaiting_snapshot, in arrival order
    absl::flat_hash_set<BlockHash, KeyHash> keys;  // keys this holder has a Holding for
  };

  // The helpers below run under mu_: FindSlot and RecordIsLive shared or exclusive, the rest
  // exclusive.
  absl::StatusOr<uint32_t> FindSlot(absl::string_view holder_id) const;
  // Makes `incarnation` current: a newer one drops entries and resets the cursor. False for an
  // older one.
  bool AdoptIncarnation(uint32_t slot, uint64_t incarnation);
  EventOutcome ApplyOrdered(uint32_t slot, const HolderEvent& event);
  // Replays buffered events after a snapshot; kGap at a hole.
  EventOutcome ReplayBuffer(uint32_t slot);
  void ApplyBody(uint32_t slot, const HolderEvent& event);

  void AddTier(uint32_t slot, const BlockHash& key, HolderTier tier);
  void AddPrediction(uint32_t slot, const BlockHash& key, absl::Time expires);
  // Clears `clear_bits` of the holding; erases it (and the key) when nothing is left.
  void ClearBits(uint32_t slot, const BlockHash& key, uint8_t clear_bits);
  // Clears `clear_bits` on every key of the holder.
  void ClearHolder(uint32_t slot, uint8_t clear_bits);
  // Makes room for one more entry; false when only event-fed entries are left.
  bool ReserveEntry();
  // Pops dead records and frees expired predictions off the front of the queue; `evict_one`
  // also frees the oldest live prediction when nothing expired. Returns predictions freed.
  size_t TrimPredictions(absl::Time now, bool evict_one);
  bool RecordIsLive(const PredictionRecord& record) const;
  void CompactPredictionQueue();

  const PrefixIndexOptions options_;
  const uint8_t all_tier_bits_;

  // std::shared_mutex rather than absl::Mutex: Debian's Abseil is not built with ThreadSanitizer
  // annotations, so TSan would report false races (as in common/thread_pool.h). Every member
  // below it is guarded by it.
  mutable std::shared_mutex mu_;
  absl::flat_hash_map<BlockHash, HoldingList, KeyHash> map_;
  std::vector<Holder> holders_;  // by slot
  std::vector<uint32_t> free_slots_;
  absl::flat_hash_map<std::string, uint32_t> slot_by_id_;
  std::deque<PredictionRecord> predictions_;
  uint64_t next_stamp_ = 1;
  size_t entries_ = 0;
  size_t live_predictions_ = 0;
  PrefixIndexStats counters_;  // the uint64_t counters only
};

}  // namespace strata::router
