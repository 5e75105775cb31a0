#include "kvstore/shared_tier_source.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/block_reader.h"

namespace strata::kvstore {
namespace {

// Prefix keys remembered for Get, per generation: a request's chain is looked up just before its
// blocks are read, so two generations of this many cover every request in flight.
constexpr size_t kMaxRemembered = 1 << 16;

}  // namespace

SharedTierBlockSource::SharedTierBlockSource(SharedTierOptions options, absl::Duration retry_after)
    : options_(std::move(options)), retry_after_(retry_after) {}

absl::StatusOr<SharedTier*> SharedTierBlockSource::Tier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (tier_ != nullptr) return tier_.get();
    if (connecting_ || absl::Now() < next_attempt_) {
      return absl::UnavailableError(absl::StrCat(
          "shared tier: not connected (", connecting_ ? "connecting" : last_error_.message(), ")"));
    }
    connecting_ = true;  // this caller connects; the others are told so meanwhile
  }
  absl::StatusOr<std::unique_ptr<SharedTier>> t = SharedTier::Connect(options_);
  std::lock_guard<std::mutex> lock(mu_);
  connecting_ = false;
  if (!t.ok()) {
    last_error_ = t.status();
    next_attempt_ = absl::Now() + retry_after_;
    return absl::UnavailableError(absl::StrCat("shared tier: ", t.status().message()));
  }
  tier_ = *std::move(t);
  return tier_.get();
}

SharedTier* SharedTierBlockSource::tier() {
  std::lock_guard<std::mutex> lock(mu_);
  return tier_.get();
}

void SharedTierBlockSource::Remember(const BlockHash& key, uint32_t chunk) {
  std::lock_guard<std::mutex> lock(keys_mu_);
  if (chunk_of_.size() >= kMaxRemembered) {
    older_ = std::move(chunk_of_);
    chunk_of_.clear();
  }
  chunk_of_[key] = chunk;
}

void SharedTierBlockSource::NoteChain(absl::Span<const BlockHash> chain) {
  for (uint32_t c = 0; c < chain.size(); ++c) Remember(chain[c], c);
}

absl::StatusOr<uint32_t> SharedTierBlockSource::Lookup(
    const BlockName& prefix, absl::Span<const BlockHash> chain,
    absl::Span<const uint64_t> layer_codec_fingerprints) {
  absl::StatusOr<SharedTier*> tier = Tier();
  if (!tier.ok()) return tier.status();
  // Every layer of up to kChunksPerCall chunks in one pipelined call, from the first chunk: a
  // chunk counts only when its whole prefix does, so the walk stops at the first one missing.
  constexpr uint32_t kChunksPerCall = 64;
  const uint32_t layers = static_cast<uint32_t>(layer_codec_fingerprints.size());
  if (layers == 0) return 0u;
  uint32_t found = 0;
  for (uint32_t first = 0; first < chain.size(); first += kChunksPerCall) {
    const uint32_t end =
        std::min<uint32_t>(static_cast<uint32_t>(chain.size()), first + kChunksPerCall);
    std::vector<SharedTier::Key> keys;
    for (uint32_t c = first; c < end; ++c) {
      for (uint32_t l = 0; l < layers; ++l) {
        BlockName n = prefix;
        n.key = chain[c];
        n.layer = l;
        n.codec_fingerprint = layer_codec_fingerprints[l];
        keys.push_back({.name = n, .chunk_index = c});
      }
    }
    const std::vector<absl::StatusOr<bool>> present = (*tier)->Contains(keys);
    for (uint32_t c = first; c < end; ++c) {
      for (uint32_t l = 0; l < layers; ++l) {
        const absl::StatusOr<bool>& p = present[(c - first) * layers + l];
        if (!p.ok()) return c == 0 ? absl::StatusOr<uint32_t>(p.status()) : found;
        if (!*p) return found;
      }
      Remember(chain[c], c);
      found = c + 1;
    }
  }
  return found;
}

absl::StatusOr<SharedBytes> SharedTierBlockSource::Get(const BlockName& name) {
  uint32_t chunk = 0;
  {
    std::lock_guard<std::mutex> lock(keys_mu_);
    if (auto it = chunk_of_.find(name.key); it != chunk_of_.end()) {
      chunk = it->second;
    } else if (auto old = older_.find(name.key); old != older_.end()) {
      chunk = old->second;
    } else {
      return absl::NotFoundError(absl::StrCat("shared tier: ", name.ToString(),
                                              " was not looked up (its chunk index is "
                                              "unknown)"));
    }
  }
  absl::StatusOr<SharedTier*> tier = Tier();
  if (!tier.ok()) return tier.status();
  std::vector<absl::StatusOr<SharedBytes>> got =
      (*tier)->Get({{.name = name, .chunk_index = chunk}});
  return std::move(got[0]);
}

absl::Status SharedTierBlockSource::Put(const BlockName& name, const BlockHash* parent,
                                        SharedBytes block) {
  (void)parent;  // the tier keeps no parent links: its TTLs keep chains together
  absl::StatusOr<BlockView> view = BlockView::Parse(block.span(), {.verify_checksum = false});
  if (!view.ok()) return view.status();
  const uint32_t chunk = view->header().chunk_index;
  absl::StatusOr<SharedTier*> tier = Tier();
  if (!tier.ok()) return tier.status();
  std::vector<absl::Status> put =
      (*tier)->Put({{.name = name, .chunk_index = chunk, .block = std::move(block)}});
  if (put[0].ok()) Remember(name.key, chunk);
  return put[0];
}

std::string SharedTierBlockSource::Describe() const {
  return absl::StrCat("shared tier on ", absl::StrJoin(options_.redis.seeds, ","));
}

bool FailoverBlockSource::Unreachable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

absl::StatusOr<uint32_t> FailoverBlockSource::Lookup(
    const BlockName& prefix, absl::Span<const BlockHash> chain,
    absl::Span<const uint64_t> layer_codec_fingerprints) {
  absl::StatusOr<uint32_t> r = primary_->Lookup(prefix, chain, layer_codec_fingerprints);
  if (r.ok()) {
    // The Gets that follow may find the primary gone: the fallback then serves them.
    fallback_->NoteChain(chain.first(std::min<size_t>(*r, chain.size())));
    return r;
  }
  if (!Unreachable(r.status())) return r;
  absl::StatusOr<uint32_t> f = fallback_->Lookup(prefix, chain, layer_codec_fingerprints);
  (f.ok() ? lookups_ : failed_).fetch_add(1, std::memory_order_relaxed);
  return f.ok() ? f : r;
}

absl::StatusOr<SharedBytes> FailoverBlockSource::Get(const BlockName& name) {
  absl::StatusOr<SharedBytes> r = primary_->Get(name);
  if (r.ok() || !Unreachable(r.status())) return r;
  absl::StatusOr<SharedBytes> f = fallback_->Get(name);
  (f.ok() ? gets_ : failed_).fetch_add(1, std::memory_order_relaxed);
  return f.ok() ? f : r;
}

absl::Status FailoverBlockSource::Put(const BlockName& name, const BlockHash* parent,
                                      SharedBytes block) {
  absl::Status r = primary_->Put(name, parent, block);
  if (r.ok() || !Unreachable(r)) return r;
  absl::Status f = fallback_->Put(name, parent, std::move(block));
  (f.ok() ? puts_ : failed_).fetch_add(1, std::memory_order_relaxed);
  return f.ok() ? f : r;
}

absl::StatusOr<std::vector<absl::Status>> FailoverBlockSource::PutMany(
    absl::Span<const PutItem> items) {
  absl::StatusOr<std::vector<absl::Status>> r = primary_->PutMany(items);
  if (!r.ok() && !Unreachable(r.status())) return r;
  std::vector<absl::Status> out =
      r.ok() ? *std::move(r) : std::vector<absl::Status>(items.size(), r.status());
  for (size_t i = 0; i < items.size() && i < out.size(); ++i) {
    if (!Unreachable(out[i])) continue;
    const PutItem& item = items[i];
    absl::Status f =
        fallback_->Put(item.name, item.parent.has_value() ? &*item.parent : nullptr, item.block);
    (f.ok() ? puts_ : failed_).fetch_add(1, std::memory_order_relaxed);
    if (f.ok()) out[i] = f;
  }
  return out;
}

std::string FailoverBlockSource::Describe() const {
  return absl::StrCat(primary_->Describe(), ", then ", fallback_->Describe(),
                      " while it cannot answer");
}

FailoverBlockSource::Stats FailoverBlockSource::stats() const {
  return {.lookups = lookups_.load(),
          .gets = gets_.load(),
          .puts = puts_.load(),
          .failed = failed_.load()};
}

}  // namespace strata::kvstore
