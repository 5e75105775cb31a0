#include "kvstore/shared_tier.h"

#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/aligned_buffer.h"
#include "common/block_reader.h"

namespace strata::kvstore {

absl::Status SharedTierOptions::Validate() const {
  if (absl::Status s = redis.Validate(); !s.ok()) return s;
  if (ttl <= absl::ZeroDuration() || root_bonus < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shared tier: ttl must be > 0 and root_bonus >= 0");
  }
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("shared tier: timeout");
  return absl::OkStatus();
}

std::string SharedTier::KeyOf(const BlockName& name) const {
  BlockName chunk = name;
  chunk.layer = 0;
  return absl::StrCat(options_.key_prefix, "c:", chunk.Encode());
}

std::string SharedTier::FieldOf(const BlockName& name) { return absl::StrCat(name.layer); }

absl::StatusOr<std::unique_ptr<SharedTier>> SharedTier::Connect(SharedTierOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<RedisCluster>> redis = RedisCluster::Connect(options.redis);
  if (!redis.ok()) return redis.status();
  return std::unique_ptr<SharedTier>(new SharedTier(std::move(options), *std::move(redis)));
}

absl::Status SharedTier::Check(const BlockName& name, uint32_t chunk_index,
                               absl::Span<const uint8_t> bytes, bool checksum_verified) const {
  // Structure, and the CRC-32C unless verified already.
  absl::StatusOr<BlockView> view = BlockView::Parse(bytes, {.verify_checksum = !checksum_verified});
  if (!view.ok()) return view.status();
  const BlockHeader& h = view->header();
  if (h.layer != name.layer || h.chunk_index != chunk_index ||
      h.codec_fingerprint != name.codec_fingerprint ||
      h.model_fingerprint != name.model_fingerprint ||
      h.calibration_fingerprint != name.calibration_fingerprint) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared tier: the block (layer ", h.layer, ", chunk ", h.chunk_index,
                     ") is not the one named ", name.ToString(), " at chunk ", chunk_index));
  }
  return absl::OkStatus();
}

std::vector<absl::Status> SharedTier::Put(absl::Span<const Item> items) {
  const absl::Time start = absl::Now();
  std::vector<absl::Status> out(items.size());
  // The values go to hiredis as views of the blocks' own bytes (no copy before its buffer).
  std::vector<std::string> keys, fields, ttls;
  std::vector<size_t> sent;
  keys.reserve(items.size());
  fields.reserve(items.size());
  ttls.reserve(items.size());
  uint64_t bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    if (absl::Status s = Check(it.name, it.chunk_index, it.block.span(), it.checksum_verified);
        !s.ok()) {
      out[i] = s;
      continue;
    }
    keys.push_back(KeyOf(it.name));
    fields.push_back(FieldOf(it.name));
    ttls.push_back(absl::StrCat(absl::ToInt64Milliseconds(TtlFor(it.chunk_index))));
    sent.push_back(i);
    bytes += it.block.size();
  }
  // HSET per block, and PEXPIRE once per chunk right after its first layer's HSET (a key's
  // commands run in order on its node; HSET keeps a key's TTL): the chunk's TTL set (again) by
  // the call, and a key never without one for longer than a command, even if the call stops
  // partway through a long pipeline.
  struct Chunk {
    size_t expire = 0;    // its PEXPIRE's place among the commands
    bool all_set = true;  // every HSET of its layers succeeded
  };
  absl::flat_hash_map<absl::string_view, Chunk> chunks;  // by key
  std::vector<RedisCommandView> cmds;
  std::vector<size_t> hset_at(sent.size());
  for (size_t k = 0; k < sent.size(); ++k) {
    const SharedBytes& b = items[sent[k]].block;
    hset_at[k] = cmds.size();
    cmds.push_back({"HSET", keys[k], fields[k],
                    absl::string_view(reinterpret_cast<const char*>(b.data()), b.size())});
    if (chunks.try_emplace(keys[k], Chunk{.expire = cmds.size()}).second) {
      cmds.push_back({"PEXPIRE", keys[k], ttls[k]});
    }
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  std::vector<absl::StatusOr<RedisReply>> replies = redis_->RunViews(cmds, deadline);
  for (size_t k = 0; k < sent.size(); ++k) {
    chunks[keys[k]].all_set &= replies[hset_at[k]].ok();
  }
  // A PEXPIRE that found no key (0) while its HSETs succeeded: an HSET was retried after it (a
  // CLUSTERDOWN, say) and made the key afresh, without a TTL. Set it again.
  std::vector<size_t> again;  // the PEXPIREs' places
  for (const auto& [key, chunk] : chunks) {
    const absl::StatusOr<RedisReply>& e = replies[chunk.expire];
    if (chunk.all_set && e.ok() && e->type == RedisReply::Type::kInteger && e->integer == 0) {
      again.push_back(chunk.expire);
    }
  }
  if (!again.empty()) {
    std::vector<RedisCommandView> expire;
    for (size_t at : again) expire.push_back(cmds[at]);
    std::vector<absl::StatusOr<RedisReply>> second = redis_->RunViews(expire, deadline);
    for (size_t i = 0; i < again.size(); ++i) {
      absl::StatusOr<RedisReply>& r = replies[again[i]];
      if (!second[i].ok()) {
        r = second[i].status();
      } else if (second[i]->type == RedisReply::Type::kInteger && second[i]->integer == 0) {
        r = absl::UnavailableError(
            absl::StrCat("shared tier: the chunk's key was gone when its TTL was set"));
      }
    }
  }
  uint64_t errors = 0;
  for (size_t k = 0; k < sent.size(); ++k) {  // written when its HSET and its chunk's PEXPIRE are
    const absl::StatusOr<RedisReply>& set = replies[hset_at[k]];
    const absl::Status s = !set.ok() ? set.status() : replies[chunks[keys[k]].expire].status();
    if (!s.ok()) {
      out[sent[k]] = s;
      ++errors;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.puts += sent.size() - errors;
  stats_.put_errors += errors + (items.size() - sent.size());
  stats_.bytes_written += bytes;
  stats_.put_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return out;
}

std::vector<absl::StatusOr<SharedBytes>> SharedTier::Get(absl::Span<const Key> keys) {
  const absl::Time start = absl::Now();
  std::vector<std::string> names, fields, ttls;
  names.reserve(keys.size());
  fields.reserve(keys.size());
  ttls.reserve(keys.size());
  std::vector<RedisCommandView> cmds;
  for (const Key& k : keys) {
    names.push_back(KeyOf(k.name));
    fields.push_back(FieldOf(k.name));
    ttls.push_back(absl::StrCat(absl::ToInt64Milliseconds(TtlFor(k.chunk_index))));
  }
  // HGET per block, and PEXPIRE once per chunk to renew it (a no-op on a key that is not there):
  // a promotion reads every layer of a chunk, and one renewal serves them all.
  for (size_t i = 0; i < keys.size(); ++i) cmds.push_back({"HGET", names[i], fields[i]});
  absl::flat_hash_set<absl::string_view> renewed;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (renewed.insert(names[i]).second) cmds.push_back({"PEXPIRE", names[i], ttls[i]});
  }
  // Values straight into aligned buffers: parsed and kept as they arrive.
  std::vector<absl::StatusOr<RedisReply>> replies =
      redis_->RunViews(cmds, absl::Now() + options_.timeout, /*aligned_strings=*/true);
  // The HGETs' replies; a renewal that failed only shortens a chunk's life.
  replies.erase(replies.begin() + static_cast<ptrdiff_t>(keys.size()), replies.end());
  std::vector<absl::StatusOr<SharedBytes>> out;
  out.reserve(keys.size());
  uint64_t hits = 0, misses = 0, damaged = 0, errors = 0, bytes = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!replies[i].ok()) {
      out.push_back(replies[i].status());
      ++errors;
      continue;
    }
    if (replies[i]->type != RedisReply::Type::kString) {
      out.push_back(absl::NotFoundError(absl::StrCat("shared tier: no ", keys[i].name.ToString())));
      ++misses;
      continue;
    }
    SharedBytes& v = replies[i]->bytes;
    if (absl::Status s = Check(keys[i].name, keys[i].chunk_index, v.span()); !s.ok()) {
      out.push_back(absl::NotFoundError(absl::StrCat("shared tier: a damaged value under ",
                                                     keys[i].name.ToString(), ": ", s.message())));
      ++damaged;
      ++misses;
      continue;
    }
    bytes += v.size();
    ++hits;
    out.push_back(std::move(v));
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.gets += keys.size();
  stats_.hits += hits;
  stats_.misses += misses;
  stats_.damaged += damaged;
  stats_.get_errors += errors;
  stats_.bytes_read += bytes;
  stats_.get_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return out;
}

std::vector<absl::StatusOr<bool>> SharedTier::Contains(absl::Span<const Key> keys) {
  std::vector<RedisCommand> cmds;
  for (const Key& k : keys) cmds.push_back({"HEXISTS", KeyOf(k.name), FieldOf(k.name)});
  std::vector<absl::StatusOr<RedisReply>> replies =
      redis_->Run(cmds, absl::Now() + options_.timeout);
  std::vector<absl::StatusOr<bool>> out;
  for (auto& r : replies) {
    if (!r.ok()) {
      out.push_back(r.status());
    } else {
      out.push_back(r->type == RedisReply::Type::kInteger && r->integer > 0);
    }
  }
  return out;
}

SharedTierStats SharedTier::Stats() const {
  SharedTierStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  s.redis = redis_->Stats();
  return s;
}

}  // namespace strata::kvstore
