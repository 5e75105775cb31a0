#include "decode_node/decode_engine.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "decode_node/batch_planner.h"
#include "model/text_stream.h"
#include "transport/shipment.h"

namespace strata::decode {

struct DecodeEngine::Sequence {
  DecodeRequest req;
  std::shared_ptr<TokenSink> sink;
  absl::Time deadline;
  std::atomic<bool> cancelled{false};
  // Arriving KV (guarded by mu_).
  std::vector<std::vector<SharedBytes>> blocks;  // [chunk][layer]
  std::vector<SharedBytes> windows;              // [layer]
  std::optional<transport::ShipmentEnd> end;
  absl::Status aborted;
  uint64_t arrived_bytes = 0;
  bool queued = false;  // in ready_ or running
  // Running state (the scheduler thread only).
  std::unique_ptr<model::KvCache> cache;
  std::unique_ptr<model::TextStream> text;
  std::optional<model::Sampler> sampler;
  std::vector<uint32_t> generated;
  bool preempted = false;
  uint32_t preempted_chunks = 0;
  std::vector<std::string> saved_windows;
  uint64_t saved_bytes = 0;
  // The store names of the arrived blocks, [chunk * layers + layer] (NameArrivedBlocks).
  std::vector<std::string> block_names;
  DecodeUsage usage;
};

absl::Status DecodeEngineOptions::Validate() const {
  STRATA_RETURN_IF_ERROR(format.Validate());
  if (max_batch < 1) return absl::InvalidArgumentError("decode: max_batch must be >= 1");
  if (kv_budget_bytes == 0)
    return absl::InvalidArgumentError("decode: kv_budget_bytes must be > 0");
  if (kv_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("decode: kv_timeout must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DecodeEngine>> DecodeEngine::Create(
    DecodeEngineOptions options, const model::ComputeBackend* model,
    const model::Tokenizer* tokenizer, transport::Transport* transport,
    kvstore::BlockSource* store) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (model == nullptr || tokenizer == nullptr || transport == nullptr) {
    return absl::InvalidArgumentError("decode: needs a model, a tokenizer and a transport");
  }
  // An empty cache of the engine's options: it checks them, and names arriving blocks before
  // their sequence has a cache of its own (NameArrivedBlocks).
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::KvCache> namer,
                          model->NewCache(options.format.CacheOptions()));
  std::unique_ptr<DecodeEngine> e(
      new DecodeEngine(std::move(options), model, tokenizer, transport, store));
  e->namer_ = std::move(namer);
  DecodeEngine* raw = e.get();
  transport::BlockReceiverOptions ro;
  // Arrived blocks stay in the receiver's memory while their sequence lives (no copy): the
  // receiver may hold the whole KV budget and a margin for blocks in flight.
  ro.max_pending_bytes =
      std::max<uint64_t>(ro.max_pending_bytes, raw->options_.kv_budget_bytes * 2);
  STRATA_ASSIGN_OR_RETURN(e->receiver_, transport::BlockReceiver::Create(
                                            transport, ro, [raw](transport::ReceivedBlock b) {
                                              return raw->Consume(std::move(b));
                                            }));
  e->thread_ = std::thread([raw] { raw->Loop(); });
  return e;
}

DecodeEngine::~DecodeEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  receiver_.reset();  // no more Consume calls
  std::vector<std::shared_ptr<Sequence>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : by_id_) left.push_back(s);
    by_id_.clear();
    ready_.clear();
    running_.clear();
  }
  for (auto& s : left) {
    if (!s->cancelled) s->sink->Fail(absl::UnavailableError("decode: the node is shutting down"));
  }
}

absl::Status DecodeEngine::Start(DecodeRequest request, std::shared_ptr<TokenSink> sink) {
  STRATA_RETURN_IF_ERROR(transport::ValidateRequestId(request.request_id));
  STRATA_RETURN_IF_ERROR(request.sampling.Validate());
  if (request.prompt.empty()) return absl::InvalidArgumentError("decode: empty prompt");
  if (request.max_tokens < 1) return absl::InvalidArgumentError("decode: max_tokens must be >= 1");
  if (sink == nullptr) return absl::InvalidArgumentError("decode: no sink");
  auto s = std::make_shared<Sequence>();
  s->req = std::move(request);
  s->sink = std::move(sink);
  s->deadline = s->req.deadline != absl::InfiniteFuture() ? s->req.deadline
                                                          : absl::Now() + options_.kv_timeout;
  std::lock_guard<std::mutex> lock(mu_);
  // Under mu_: Drain sees every sequence registered before it set the flag.
  if (draining_.load()) {
    return absl::UnavailableError("decode: the node is draining (leaving the cluster)");
  }
  if (by_id_.contains(s->req.request_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("decode: request ", s->req.request_id, " is already registered"));
  }
  if (load_.waiting >= options_.MaxWaiting()) {
    return absl::ResourceExhaustedError(absl::StrCat("decode: ", load_.waiting,
                                                     " requests waiting, the limit is ",
                                                     options_.MaxWaiting(), "; retry later"));
  }
  ++load_.waiting;
  ++stats_.requests;
  by_id_[s->req.request_id] = s;
  return absl::OkStatus();
}

uint64_t DecodeEngine::Drain(absl::Time deadline) {
  uint64_t before;
  {
    std::lock_guard<std::mutex> lock(mu_);  // as Start reads it: no registration slips past
    draining_.store(true);
    before = stats_.handed_off;
  }
  while (absl::Now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (by_id_.empty()) return 0;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    hand_off_ = true;
  }
  cv_.notify_all();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!hand_off_ || stop_) return stats_.handed_off - before;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

void DecodeEngine::HandOffAll() {
  std::vector<std::shared_ptr<Sequence>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : by_id_) all.push_back(s);
    by_id_.clear();
    ready_.clear();
    running_.clear();
    load_ = DecodeLoad{};
  }
  uint64_t handed = 0, failed = 0;
  for (auto& s : all) {
    if (s->cancelled) continue;
    if (s->generated.empty() || s->text == nullptr) {  // nothing streamed: routed again instead
      s->sink->Fail(absl::UnavailableError(absl::StrCat(
          "decode: request ", s->req.request_id, ": the node is draining (leaving the cluster)")));
      ++failed;
      continue;
    }
    // Its full chunks to the store (a preempted sequence's are there), so that the node that
    // continues it adopts them instead of computing them again.
    if (store_ != nullptr && options_.put_to_store && !s->preempted && s->cache != nullptr) {
      const uint32_t chunks = static_cast<uint32_t>(s->cache->blocks_per_layer());
      absl::StatusOr<std::vector<BlockHash>> keys = ChunkKeys(*s, s->cache->tokens());
      absl::Status st = keys.status();
      if (keys.ok()) {
        absl::StatusOr<std::vector<absl::Status>> put =
            store_->PutMany(PutItems(*s, *keys, 0, chunks));
        st = put.status();
        if (put.ok()) {
          for (const absl::Status& one : *put) {
            if (!one.ok() && !absl::IsAlreadyExists(one)) st = one;
          }
        }
      }
      if (!st.ok()) {  // the continuation computes them again: slower, not wrong
        Log(s->req.request_id, absl::StrCat("decode: hand-off Put failed: ", st.ToString()));
      }
    }
    s->sink->HandOff(static_cast<uint32_t>(s->generated.size()), s->text->Finish());
    ++handed;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.handed_off += handed;
  stats_.failed += failed;
  hand_off_ = false;
}

void DecodeEngine::Cancel(const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(request_id);
  if (it == by_id_.end()) return;
  std::shared_ptr<Sequence> s = it->second;
  s->cancelled = true;
  ++stats_.cancelled;
  // A sequence not yet running is dropped here; a running one by the scheduler's next step.
  auto r = std::find(ready_.begin(), ready_.end(), s);
  if (r != ready_.end()) ready_.erase(r);
  if (std::find(running_.begin(), running_.end(), s) == running_.end()) {
    by_id_.erase(it);
    --load_.waiting;
    load_.kv_bytes_arrived -= s->arrived_bytes;
  }
  cv_.notify_all();
}

DecodeLoad DecodeEngine::load() const {
  std::lock_guard<std::mutex> lock(mu_);
  return load_;
}

DecodeStats DecodeEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

absl::Status DecodeEngine::Consume(transport::ReceivedBlock b) {
  STRATA_ASSIGN_OR_RETURN(transport::ShipmentId id, transport::ShipmentId::Decode(b.id));
  const uint32_t L = model_->config().num_layers;
  const uint32_t max_chunks =
      model_->config().max_position_embeddings / options_.format.chunk_tokens + 1;
  if (id.layer >= L) {
    return absl::InvalidArgumentError(absl::StrCat("decode: layer ", id.layer, " of ", L));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id.request_id);
  if (it == by_id_.end()) {
    return absl::NotFoundError(absl::StrCat("decode: no request ", id.request_id,
                                            " (never registered, cancelled or timed out)"));
  }
  Sequence& s = *it->second;
  if (s.queued) {
    return absl::FailedPreconditionError(
        absl::StrCat("decode: request ", id.request_id, " is complete already"));
  }
  SharedBytes bytes({b.bytes.data(), b.bytes.size()}, b.hold);
  switch (id.kind) {
    case transport::ShipmentKind::kBlock:
      if (id.chunk >= max_chunks) {
        return absl::InvalidArgumentError(
            absl::StrCat("decode: chunk ", id.chunk, " beyond the context"));
      }
      if (s.blocks.size() <= id.chunk) s.blocks.resize(id.chunk + 1, std::vector<SharedBytes>(L));
      s.blocks[id.chunk][id.layer] = std::move(bytes);
      ++stats_.blocks_received;
      break;
    case transport::ShipmentKind::kWindow:
      s.windows.resize(L);
      s.windows[id.layer] = std::move(bytes);
      break;
    case transport::ShipmentKind::kEnd: {
      STRATA_ASSIGN_OR_RETURN(transport::ShipmentEnd end, transport::ShipmentEnd::Decode(b.bytes));
      if (end.layers != L || end.chunks > max_chunks) {
        return absl::InvalidArgumentError("decode: end shipment of another model's shape");
      }
      s.end = end;
      break;
    }
    case transport::ShipmentKind::kAbort:
      s.aborted = absl::AbortedError(absl::StrCat(
          "prefill failed: ", std::string(reinterpret_cast<const char*>(b.bytes.data()),
                                          std::min<size_t>(b.bytes.size(), 512))));
      break;
  }
  s.arrived_bytes += b.bytes.size();
  load_.kv_bytes_arrived += b.bytes.size();
  stats_.bytes_received += b.bytes.size();
  // An aborted request is complete at once, also when its end shipment came first (a block that
  // failed on its way is reported after the end was sent).
  bool complete = !s.aborted.ok();
  if (!complete && s.end.has_value() && s.windows.size() == L && s.blocks.size() >= s.end->chunks) {
    complete = true;
    for (const SharedBytes& w : s.windows) complete &= static_cast<bool>(w);
    for (uint32_t k = 0; k < s.end->chunks && complete; ++k) {
      for (const SharedBytes& blk : s.blocks[k]) complete &= static_cast<bool>(blk);
    }
  }
  if (complete) {
    s.queued = true;
    ready_.push_back(it->second);
    cv_.notify_all();
  }
  return absl::OkStatus();
}

uint64_t DecodeEngine::KvBytes(const Sequence& s) const {
  if (s.preempted) return s.saved_bytes;
  if (s.cache == nullptr) return s.arrived_bytes;
  return s.cache->block_bytes() + WindowBytes(s);
}

uint64_t DecodeEngine::WindowBytes(const Sequence& s) const {
  const model::ModelConfig& c = model_->config();
  return uint64_t{s.cache->window_tokens()} * c.num_layers * c.num_kv_heads * c.head_dim * 8;
}

uint64_t DecodeEngine::KvBytesInUse(absl::Span<const std::shared_ptr<Sequence>> seqs) const {
  // Interned blocks are the same bytes in every sequence that holds them, and those sequences
  // begin with the same blocks (a prefix): only sequences whose first block is another's first
  // block need their blocks told apart, which keeps the usual case (nothing shared) a sum.
  absl::flat_hash_map<const uint8_t*, uint32_t> first;  // first block -> sequences beginning so
  const auto First = [](const Sequence& s) -> const uint8_t* {
    if (s.preempted || s.cache == nullptr || s.cache->layers() == 0) return nullptr;
    const std::vector<SharedBytes>& b = s.cache->layer_blocks(0);
    return b.empty() ? nullptr : b[0].data();
  };
  for (const auto& s : seqs) {
    if (const uint8_t* f = First(*s); f != nullptr) ++first[f];
  }
  uint64_t n = 0;
  absl::flat_hash_set<const uint8_t*> seen;
  for (const auto& s : seqs) {
    const uint8_t* f = First(*s);
    if (f == nullptr || first[f] < 2) {
      n += KvBytes(*s);
      continue;
    }
    n += WindowBytes(*s);
    for (uint32_t l = 0; l < s->cache->layers(); ++l) {
      for (const SharedBytes& b : s->cache->layer_blocks(l)) {
        if (seen.insert(b.data()).second) n += b.size();
      }
    }
  }
  return n;
}

absl::Status DecodeEngine::NameArrivedBlocks(Sequence& s) const {
  const uint32_t L = model_->config().num_layers, chunks = s.end->chunks;
  if (!s.block_names.empty() || chunks == 0) return absl::OkStatus();
  STRATA_ASSIGN_OR_RETURN(const std::vector<BlockHash> keys, ChunkKeys(s, s.req.prompt.size()));
  if (keys.size() < chunks) {
    return absl::InvalidArgumentError(absl::StrCat("decode: the prefill node shipped ", chunks,
                                                   " chunks for a ", s.req.prompt.size(),
                                                   "-token prompt"));
  }
  s.block_names.reserve(size_t{chunks} * L);
  for (uint32_t k = 0; k < chunks; ++k) {
    for (uint32_t l = 0; l < L; ++l) s.block_names.push_back(namer_->NameOf(l, keys[k]).Encode());
  }
  return absl::OkStatus();
}

uint64_t DecodeEngine::SharedArrivedBytes(Sequence& s) {
  if (s.cache != nullptr || s.preempted || !s.aborted.ok() || !s.end.has_value()) return 0;
  if (!NameArrivedBlocks(s).ok()) return 0;  // Activate reports it
  const uint32_t L = model_->config().num_layers;
  const uint32_t chunks = std::min<uint32_t>(s.end->chunks, static_cast<uint32_t>(s.blocks.size()));
  uint64_t shared = 0;
  for (uint32_t k = 0; k < chunks; ++k) {
    for (uint32_t l = 0; l < L; ++l) {
      if (interner_.Holds(s.block_names[size_t{k} * L + l])) shared += s.blocks[k][l].size();
    }
  }
  return shared;
}

absl::Status DecodeEngine::Activate(Sequence& s) {
  if (!s.aborted.ok()) return s.aborted;
  const uint32_t L = model_->config().num_layers;
  STRATA_ASSIGN_OR_RETURN(s.cache, model_->NewCache(options_.format.CacheOptions()));
  const transport::ShipmentEnd& end = *s.end;
  STRATA_RETURN_IF_ERROR(NameArrivedBlocks(s));  // (admission has named them already)
  uint64_t shared = 0;
  for (uint32_t k = 0; k < end.chunks; ++k) {
    for (uint32_t l = 0; l < L; ++l) {
      bool reused = false;
      SharedBytes b = interner_.Intern(s.block_names[size_t{k} * L + l],
                                       std::move(s.blocks[k][l]), &reused);
      shared += reused;
      // The receiver verified the checksum where the bytes arrived: once per hop.
      STRATA_RETURN_IF_ERROR(s.cache->AdoptBlock(l, std::move(b), /*checksum_verified=*/true));
    }
  }
  if (shared > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.blocks_shared += shared;
  }
  STRATA_RETURN_IF_ERROR(s.cache->CommitAdopted());
  for (uint32_t l = 0; l < L; ++l)
    STRATA_RETURN_IF_ERROR(s.cache->ImportWindow(l, s.windows[l].span()));
  STRATA_RETURN_IF_ERROR(s.cache->CommitWindow());
  if (s.cache->tokens() != s.req.prompt.size() || end.prompt_tokens != s.req.prompt.size()) {
    return absl::InvalidArgumentError(absl::StrCat("decode: the prefill node shipped ",
                                                   s.cache->tokens(), " tokens of KV for a ",
                                                   s.req.prompt.size(), "-token prompt"));
  }
  s.blocks.clear();  // the cache holds them now
  s.block_names.clear();
  s.windows.clear();
  s.text = std::make_unique<model::TextStream>(tokenizer_, s.req.stop);
  s.sampler.emplace(s.req.sampling);
  s.usage.prompt_tokens = end.prompt_tokens;
  s.usage.cached_tokens = end.cached_tokens;
  return absl::OkStatus();
}

void DecodeEngine::SendToken(Sequence& s, uint32_t token, const std::string& text,
                             const model::TokenLogprobs* logprobs) {
  if (logprobs != nullptr) {
    s.sink->TokenWithLogprobs(token, text, *logprobs);
  } else {
    s.sink->Token(token, text);
  }
}

bool DecodeEngine::Emit(Sequence& s, uint32_t token, const model::TokenLogprobs* logprobs) {
  const model::ModelConfig& c = model_->config();
  s.generated.push_back(token);
  ++s.usage.completion_tokens;
  if (s.cancelled) return true;
  if (!s.req.ignore_eos && c.eos_token_id >= 0 && token == static_cast<uint32_t>(c.eos_token_id)) {
    const std::string rest = s.text->Finish();
    // With logprobs every token goes out (its entry), otherwise only text.
    if (logprobs != nullptr || !rest.empty()) SendToken(s, token, rest, logprobs);
    PutGenerated(s);
    s.sink->Finish(FinishReason::kStop, s.usage);
    return true;
  }
  absl::StatusOr<model::TextStream::Piece> piece = s.text->Add(token);
  if (!piece.ok()) {
    s.sink->Fail(piece.status());
    return true;
  }
  const bool length = s.generated.size() >= s.req.max_tokens ||
                      s.req.prompt.size() + s.generated.size() >= c.max_position_embeddings;
  if (!piece->stopped && length) piece->text += s.text->Finish();
  SendToken(s, token, piece->text, logprobs);
  if (piece->stopped || length) {
    PutGenerated(s);
    s.sink->Finish(piece->stopped ? FinishReason::kStop : FinishReason::kLength, s.usage);
    return true;
  }
  return false;
}

absl::StatusOr<std::vector<BlockHash>> DecodeEngine::ChunkKeys(const Sequence& s,
                                                               size_t tokens) const {
  std::vector<uint32_t> all = s.req.prompt;
  all.insert(all.end(), s.generated.begin(), s.generated.end());
  STRATA_ASSIGN_OR_RETURN(PrefixHasher hasher,
                          PrefixHasher::Create(options_.format.KeysFor(s.req.cache_salt)));
  return hasher.ChunkKeys(absl::MakeConstSpan(all).first(std::min(tokens, all.size())));
}

std::vector<kvstore::PutItem> DecodeEngine::PutItems(const Sequence& s,
                                                     const std::vector<BlockHash>& keys,
                                                     uint32_t from, uint32_t to) const {
  std::vector<kvstore::PutItem> items;
  for (uint32_t k = from; k < to; ++k) {
    for (uint32_t l = 0; l < s.cache->layers(); ++l) {
      items.push_back({.name = s.cache->NameOf(l, keys[k]),
                       .parent = k > 0 ? std::optional<BlockHash>(keys[k - 1]) : std::nullopt,
                       .block = s.cache->layer_blocks(l)[k]});
    }
  }
  return items;
}

void DecodeEngine::PutGenerated(Sequence& s) {
  if (store_ == nullptr || !options_.put_to_store || s.cache == nullptr) return;
  const uint32_t chunks = static_cast<uint32_t>(s.cache->blocks_per_layer());
  const uint32_t first = s.end.has_value() ? s.end->chunks : 0;
  if (chunks <= first) return;
  absl::StatusOr<std::vector<BlockHash>> chunk_keys = ChunkKeys(s, s.cache->tokens());
  if (!chunk_keys.ok()) return;
  const std::vector<BlockHash>& keys = *chunk_keys;
  auto put_from = [&](uint32_t from) -> absl::Status {
    const uint32_t to = std::min<uint32_t>(chunks, static_cast<uint32_t>(keys.size()));
    STRATA_ASSIGN_OR_RETURN(std::vector<absl::Status> put,
                            store_->PutMany(PutItems(s, keys, from, to)));
    for (const absl::Status& st : put) {
      if (absl::IsAlreadyExists(st)) continue;  // another writer's block holds the name
      STRATA_RETURN_IF_ERROR(st);
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.blocks_stored;
    }
    return absl::OkStatus();
  };
  absl::Status st = put_from(first);
  // The prefill node's Put of the prompt's chunks may not have landed yet: then all of them.
  if (st.code() == absl::StatusCode::kFailedPrecondition) st = put_from(0);
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.store_put_errors;
    Log(s.req.request_id, absl::StrCat("decode: store Put failed: ", st.ToString()));
  }
}

absl::Status DecodeEngine::Preempt(Sequence& s) {
  const uint32_t chunks = static_cast<uint32_t>(s.cache->blocks_per_layer());
  STRATA_ASSIGN_OR_RETURN(const std::vector<BlockHash> keys, ChunkKeys(s, s.cache->tokens()));
  STRATA_ASSIGN_OR_RETURN(std::vector<absl::Status> put,
                          store_->PutMany(PutItems(s, keys, 0, chunks)));
  // A name another writer's block already holds serves the resume as well (first writer wins).
  for (const absl::Status& st : put) {
    if (!absl::IsAlreadyExists(st)) STRATA_RETURN_IF_ERROR(st);
  }
  s.saved_windows.clear();
  for (uint32_t l = 0; l < s.cache->layers(); ++l)
    s.saved_windows.push_back(s.cache->ExportWindow(l));
  s.saved_bytes = KvBytes(s);
  s.preempted_chunks = chunks;
  s.preempted = true;
  s.cache->Clear();
  return absl::OkStatus();
}

absl::Status DecodeEngine::Resume(Sequence& s) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<BlockHash> keys,
                          ChunkKeys(s, s.req.prompt.size() + s.generated.size()));
  for (uint32_t k = 0; k < s.preempted_chunks; ++k) {
    for (uint32_t l = 0; l < s.cache->layers(); ++l) {
      absl::StatusOr<SharedBytes> b = store_->Get(s.cache->NameOf(l, keys[k]));
      if (!b.ok()) {
        return absl::UnavailableError(absl::StrCat(
            "decode: the preempted sequence's KV is gone from the store: ", b.status().message()));
      }
      bool reused = false;
      SharedBytes kept =
          interner_.Intern(s.cache->NameOf(l, keys[k]).Encode(), *std::move(b), &reused);
      if (reused) {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.blocks_shared;
      }
      STRATA_RETURN_IF_ERROR(s.cache->AdoptBlock(l, std::move(kept), store_->verified_on_get()));
    }
  }
  STRATA_RETURN_IF_ERROR(s.cache->CommitAdopted());
  for (uint32_t l = 0; l < s.cache->layers(); ++l) {
    const std::string& w = s.saved_windows[l];
    STRATA_RETURN_IF_ERROR(
        s.cache->ImportWindow(l, {reinterpret_cast<const uint8_t*>(w.data()), w.size()}));
  }
  STRATA_RETURN_IF_ERROR(s.cache->CommitWindow());
  s.saved_windows.clear();
  s.preempted = false;
  return absl::OkStatus();
}

void DecodeEngine::Loop() {
  for (;;) {
    std::vector<std::shared_ptr<Sequence>> expired, admitted;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (running_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(50),
                     [&] { return stop_ || !ready_.empty() || hand_off_; });
      }
      if (stop_) return;
      if (hand_off_) {
        lock.unlock();
        HandOffAll();
        continue;
      }
      expired = TakeExpired(absl::Now());
      admitted = TakeAdmitted();
    }
    FailExpired(expired);
    std::vector<std::shared_ptr<Sequence>> done;
    StartAdmitted(admitted, &done);
    StepBatch(&done);
    std::vector<std::shared_ptr<Sequence>> preempted = PreemptOverBudget(done);
    Retire(std::move(done), preempted);
  }
}

std::vector<std::shared_ptr<DecodeEngine::Sequence>> DecodeEngine::TakeExpired(absl::Time now) {
  std::vector<std::shared_ptr<Sequence>> expired;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    Sequence& s = *it->second;
    if (!s.queued && s.deadline < now) {
      expired.push_back(it->second);
      --load_.waiting;
      load_.kv_bytes_arrived -= s.arrived_bytes;
      by_id_.erase(it++);
    } else {
      ++it;
    }
  }
  return expired;
}

std::vector<std::shared_ptr<DecodeEngine::Sequence>> DecodeEngine::TakeAdmitted() {
  // Blocks that running sequences share count once, and so do an arrived sequence's blocks that
  // a running one holds: Activate adopts those from the held bytes.
  const BatchLimits limits{options_.max_batch, options_.kv_budget_bytes};
  const size_t places = running_.size() < limits.max_batch ? limits.max_batch - running_.size() : 0;
  std::vector<uint64_t> need;
  for (size_t i = 0; i < ready_.size() && i < places; ++i) {
    need.push_back(KvBytes(*ready_[i]) - SharedArrivedBytes(*ready_[i]));
  }
  const size_t n = PlanAdmission(limits, running_.size(), KvBytesInUse(running_), need);
  std::vector<std::shared_ptr<Sequence>> admitted(ready_.begin(), ready_.begin() + n);
  ready_.erase(ready_.begin(), ready_.begin() + n);
  return admitted;
}

void DecodeEngine::FailExpired(const std::vector<std::shared_ptr<Sequence>>& expired) {
  for (const auto& s : expired) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.failed;
    }
    s->sink->Fail(absl::DeadlineExceededError(
        absl::StrCat("decode: request ", s->req.request_id,
                     s->req.deadline != absl::InfiniteFuture()
                         ? ": its deadline passed before its KV arrived"
                         : absl::StrCat(": its KV did not arrive within kv_timeout (",
                                        absl::FormatDuration(options_.kv_timeout), ")"))));
  }
}

void DecodeEngine::StartAdmitted(const std::vector<std::shared_ptr<Sequence>>& admitted,
                                 std::vector<std::shared_ptr<Sequence>>* done) {
  for (const auto& s : admitted) {
    const bool resume = s->preempted;
    absl::Status st = resume ? Resume(*s) : Activate(*s);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!resume) {
        --load_.waiting;
        load_.kv_bytes_arrived -= s->arrived_bytes;
      } else {
        ++stats_.resumed;
      }
      if (st.ok()) running_.push_back(s);
    }
    if (!st.ok()) {
      if (!s->cancelled) s->sink->Fail(st);
      done->push_back(s);
      continue;
    }
    if (!resume && Emit(*s, s->end->first_token)) done->push_back(s);
  }
}

void DecodeEngine::StepBatch(std::vector<std::shared_ptr<Sequence>>* done) {
  // The batch: every running sequence's last token, one step.
  std::vector<std::shared_ptr<Sequence>> batch;
  for (auto& s : running_) {
    if (std::find(done->begin(), done->end(), s) == done->end() && !s->cancelled) {
      batch.push_back(s);
    }
  }
  if (batch.empty()) return;
  std::vector<absl::Span<const uint32_t>> tokens;
  std::vector<model::KvCache*> caches;
  for (auto& s : batch) {
    tokens.push_back({&s->generated.back(), 1});
    caches.push_back(s->cache.get());
  }
  absl::StatusOr<std::vector<std::vector<float>>> logits = model_->StepBatch(tokens, caches);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.steps;
    stats_.batched_sequences += batch.size();
    stats_.peak_batch = std::max<uint64_t>(stats_.peak_batch, batch.size());
  }
  const uint32_t vocab = model_->config().vocab_size;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& s = *batch[i];
    if (!logits.ok()) {
      s.sink->Fail(logits.status());
      done->push_back(batch[i]);
      continue;
    }
    const absl::Span<const float> row =
        absl::MakeConstSpan((*logits)[i]).subspan((*logits)[i].size() - vocab);
    const uint32_t token = s.sampler->Sample(row, s.generated.size(), s.req.prompt, s.generated);
    std::optional<model::TokenLogprobs> lp;
    if (s.req.logprobs) lp = model::LogprobsOf(row, token, s.req.top_logprobs);
    if (Emit(s, token, lp.has_value() ? &*lp : nullptr)) done->push_back(batch[i]);
  }
}

std::vector<std::shared_ptr<DecodeEngine::Sequence>> DecodeEngine::PreemptOverBudget(
    const std::vector<std::shared_ptr<Sequence>>& done) {
  std::vector<std::shared_ptr<Sequence>> preempted;
  if (store_ == nullptr) return preempted;  // nowhere to put them
  std::vector<std::shared_ptr<Sequence>> live;
  for (auto& s : running_) {
    if (std::find(done.begin(), done.end(), s) == done.end() && !s->cancelled) live.push_back(s);
  }
  // (A victim frees only the blocks no other live sequence holds: bytes_of_first counts shared
  // blocks once.)
  const size_t keep =
      PlanPreemption({options_.max_batch, options_.kv_budget_bytes}, live.size(),
                     [&](size_t k) { return KvBytesInUse(absl::MakeConstSpan(live).first(k)); });
  for (size_t i = live.size(); i > keep; --i) {
    const std::shared_ptr<Sequence>& victim = live[i - 1];
    if (absl::Status st = Preempt(*victim); !st.ok()) {
      Log(victim->req.request_id, absl::StrCat("decode: could not preempt: ", st.ToString()));
      break;
    }
    preempted.push_back(victim);
  }
  return preempted;
}

void DecodeEngine::Retire(std::vector<std::shared_ptr<Sequence>> done,
                          const std::vector<std::shared_ptr<Sequence>>& preempted) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : running_) {
    if (s->cancelled && std::find(done.begin(), done.end(), s) == done.end()) done.push_back(s);
  }
  for (auto& s : done) {
    running_.erase(std::remove(running_.begin(), running_.end(), s), running_.end());
    by_id_.erase(s->req.request_id);
    if (!s->cancelled) ++stats_.finished;
  }
  for (auto it = preempted.rbegin(); it != preempted.rend(); ++it) {
    running_.erase(std::remove(running_.begin(), running_.end(), *it), running_.end());
    ready_.push_front(*it);
    ++stats_.preemptions;
  }
  load_.running = static_cast<uint32_t>(running_.size());
  load_.kv_bytes_in_use = KvBytesInUse(running_);
}

}  // namespace strata::decode
