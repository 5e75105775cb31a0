#include "kvstore/block_source.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace strata::kvstore {

absl::StatusOr<uint32_t> TieredBlockSource::Lookup(
    const BlockName& prefix, absl::Span<const BlockHash> chain,
    absl::Span<const uint64_t> layer_codec_fingerprints) {
  const uint32_t local = local_->Lookup(prefix, chain, layer_codec_fingerprints).chunks;
  if (remote_ == nullptr || local == chain.size()) return local;
  absl::StatusOr<uint32_t> remote = remote_->Lookup(prefix, chain, layer_codec_fingerprints);
  if (!remote.ok()) return local;  // the store down: what this node holds still counts
  return std::max(local, *remote);
}

absl::StatusOr<SharedBytes> TieredBlockSource::Get(const BlockName& name) {
  absl::StatusOr<Lease> lease = local_->Get(name);
  if (lease.ok()) {
    local_hits_.fetch_add(1);
    return lease->shared();
  }
  if (remote_ == nullptr) return lease.status();
  absl::StatusOr<SharedBytes> b = remote_->Get(name);
  if (b.ok()) remote_hits_.fetch_add(1);
  return b;
}

absl::Status TieredBlockSource::Put(const BlockName& name, const BlockHash* parent,
                                    SharedBytes block) {
  absl::Status local = local_->Put(name, parent, block);
  if (!local.ok()) local_put_errors_.fetch_add(1);
  if (remote_ == nullptr) return local;
  absl::Status remote = remote_->Put(name, parent, std::move(block));
  if (!remote.ok() && local.ok()) remote_put_errors_.fetch_add(1);
  return local.ok() ? local : remote;
}

absl::StatusOr<std::vector<absl::Status>> TieredBlockSource::PutMany(
    absl::Span<const PutItem> items) {
  std::vector<absl::Status> out;
  out.reserve(items.size());
  for (const PutItem& item : items) {
    absl::Status s =
        local_->Put(item.name, item.parent.has_value() ? &*item.parent : nullptr, item.block);
    if (!s.ok()) local_put_errors_.fetch_add(1);
    out.push_back(std::move(s));
  }
  if (remote_ == nullptr) return out;
  // A block this node holds is stored for its purposes (a preempted sequence resumes from it)
  // whatever the shared store answered; the store's failures are counted.
  absl::StatusOr<std::vector<absl::Status>> remote = remote_->PutMany(items);
  for (size_t i = 0; i < out.size(); ++i) {
    const absl::Status r = remote.ok() && i < remote->size() ? (*remote)[i] : remote.status();
    if (!r.ok() && out[i].ok()) remote_put_errors_.fetch_add(1);
    if (!out[i].ok()) out[i] = r;
  }
  return out;
}

std::string TieredBlockSource::Describe() const {
  return absl::StrCat("local RAM tier", remote_ != nullptr ? " + " + remote_->Describe() : "");
}

TieredBlockSource::Stats TieredBlockSource::stats() const {
  return {.local_hits = local_hits_.load(),
          .remote_hits = remote_hits_.load(),
          .local_put_errors = local_put_errors_.load(),
          .remote_put_errors = remote_put_errors_.load()};
}

}  // namespace strata::kvstore
