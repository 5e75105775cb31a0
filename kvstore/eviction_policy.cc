#include "kvstore/eviction_policy.h"

#include <algorithm>
#include <list>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace strata::kvstore {

absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name) {
  if (name == "lru") return PolicyKind::kLru;
  if (name == "s3fifo") return PolicyKind::kS3Fifo;
  return absl::InvalidArgumentError(
      absl::StrCat("eviction policy '", name, "' is not one of: lru, s3fifo"));
}

const char* PolicyName(PolicyKind kind) { return kind == PolicyKind::kLru ? "lru" : "s3fifo"; }

namespace {

class Lru : public EvictionPolicy {
 public:
  void Insert(uint64_t id, size_t) override {
    order_.push_front(id);
    where_[id] = order_.begin();
  }
  void Access(uint64_t id) override {
    auto it = where_.find(id);
    if (it == where_.end()) return;
    order_.splice(order_.begin(), order_, it->second);
  }
  void Erase(uint64_t id) override {
    auto it = where_.find(id);
    if (it == where_.end()) return;
    order_.erase(it->second);
    where_.erase(it);
  }
  void Evict(uint64_t id) override { Erase(id); }
  std::optional<uint64_t> Victim(const std::function<bool(uint64_t)>& pinned) override {
    // A pinned entry (leased, or a prefix with resident descendants) counts as just used: it
    // moves to the front, so repeated searches stay cheap.
    for (size_t n = order_.size(); n > 0 && !order_.empty(); --n) {
      const uint64_t id = order_.back();
      if (!pinned(id)) return id;
      order_.splice(order_.begin(), order_, std::prev(order_.end()));
    }
    return std::nullopt;
  }
  size_t size() const override { return where_.size(); }

 private:
  std::list<uint64_t> order_;  // most recent first
  absl::flat_hash_map<uint64_t, std::list<uint64_t>::iterator> where_;
};

class S3Fifo : public EvictionPolicy {
 public:
  explicit S3Fifo(size_t capacity) : small_target_(std::max<size_t>(1, capacity / 10)) {}

  void Insert(uint64_t id, size_t bytes) override {
    const bool ghost = ghost_where_.contains(id);
    if (ghost) {
      ghost_.erase(ghost_where_[id]);
      ghost_where_.erase(id);
    }
    Queue q = ghost ? kMain : kSmall;
    list(q).push_front(id);
    entries_[id] = {q, 0, bytes, list(q).begin()};
    (q == kSmall ? small_bytes_ : main_bytes_) += bytes;
  }
  void Access(uint64_t id) override {
    auto it = entries_.find(id);
    if (it != entries_.end()) it->second.freq = std::min(3, it->second.freq + 1);
  }
  void Erase(uint64_t id) override { Remove(id, /*ghost=*/false); }
  void Evict(uint64_t id) override { Remove(id, /*ghost=*/true); }

  std::optional<uint64_t> Victim(const std::function<bool(uint64_t)>& pinned) override {
    // Each entry moves at most a few times (freq <= 3, one small -> main move); bound the walk
    // so a fully pinned tier answers nullopt.
    size_t budget = 5 * entries_.size() + 2;
    while (budget-- > 0 && !entries_.empty()) {
      const bool from_small = !small_.empty() && (small_bytes_ >= small_target_ || main_.empty());
      std::list<uint64_t>& q = from_small ? small_ : main_;
      const uint64_t id = q.back();
      Entry& e = entries_[id];
      if (pinned(id)) {  // in use: back to the head of its queue
        q.splice(q.begin(), q, e.pos);
        continue;
      }
      if (from_small) {
        if (e.freq > 0) {  // hit while new: promote to the main FIFO
          main_.splice(main_.begin(), small_, e.pos);
          e.queue = kMain;
          e.freq = 0;
          small_bytes_ -= e.bytes;
          main_bytes_ += e.bytes;
          continue;
        }
        return id;
      }
      if (e.freq > 0) {  // another lap
        --e.freq;
        main_.splice(main_.begin(), main_, e.pos);
        continue;
      }
      return id;
    }
    return std::nullopt;
  }
  size_t size() const override { return entries_.size(); }

 private:
  enum Queue { kSmall, kMain };
  struct Entry {
    Queue queue;
    int freq;
    size_t bytes;
    std::list<uint64_t>::iterator pos;
  };
  std::list<uint64_t>& list(Queue q) { return q == kSmall ? small_ : main_; }

  void Remove(uint64_t id, bool ghost) {
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    Entry& e = it->second;
    list(e.queue).erase(e.pos);
    (e.queue == kSmall ? small_bytes_ : main_bytes_) -= e.bytes;
    const bool was_small = e.queue == kSmall;
    entries_.erase(it);
    if (ghost && was_small) {  // remember it: back soon means it belongs in main
      ghost_.push_front(id);
      ghost_where_[id] = ghost_.begin();
      while (ghost_.size() > std::max<size_t>(16, entries_.size())) {
        ghost_where_.erase(ghost_.back());
        ghost_.pop_back();
      }
    }
  }

  const size_t small_target_;
  size_t small_bytes_ = 0, main_bytes_ = 0;
  std::list<uint64_t> small_, main_, ghost_;  // heads are the newest
  absl::flat_hash_map<uint64_t, Entry> entries_;
  absl::flat_hash_map<uint64_t, std::list<uint64_t>::iterator> ghost_where_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakePolicy(PolicyKind kind, size_t capacity_bytes) {
  if (kind == PolicyKind::kLru) return std::make_unique<Lru>();
  return std::make_unique<S3Fifo>(capacity_bytes);
}

}  // namespace strata::kvstore
