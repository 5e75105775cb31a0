#include "prefill_node/prefill_engine.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "prefill_node/kv_shipment.h"
#include "transport/shipment.h"

namespace strata::prefill {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

absl::Status PrefillEngineOptions::Validate() const {
  STRATA_RETURN_IF_ERROR(format.Validate());
  if (max_concurrent < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill: max_concurrent must be >= 1, got ", max_concurrent));
  }
  if (ship_timeout <= absl::ZeroDuration() || connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("prefill: timeouts must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PrefillEngine>> PrefillEngine::Create(
    PrefillEngineOptions options, const model::ComputeBackend* model,
    transport::Transport* transport, kvstore::BlockSource* store) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (model == nullptr || transport == nullptr) {
    return absl::InvalidArgumentError("prefill: needs a model and a transport");
  }
  // A cache of this codec must be constructible (a calibration present when needed).
  STRATA_RETURN_IF_ERROR(model->NewCache(options.format.CacheOptions()).status());
  std::unique_ptr<PrefillEngine> e(new PrefillEngine(std::move(options), model, transport, store));
  STRATA_ASSIGN_OR_RETURN(e->sender_,
                          transport::BlockSender::Create(transport, {.timeout = e->options_.ship_timeout}));
  return e;
}

PrefillEngine::~PrefillEngine() = default;

PrefillLoad PrefillEngine::load() const {
  std::lock_guard<std::mutex> lock(mu_);
  PrefillLoad l = load_;
  l.max_queued_tokens = QueueLimit();
  l.tokens_per_second = tokens_per_second_;
  return l;
}

uint64_t PrefillEngine::QueueLimit() const {
  if (tokens_per_second_ <= 0 || options_.max_queue_time <= absl::ZeroDuration()) {
    return options_.max_queued_tokens;
  }
  // max_concurrent prompts are served side by side (each at about the measured rate).
  const double tokens =
      tokens_per_second_ * options_.max_concurrent * absl::ToDoubleSeconds(options_.max_queue_time);
  return std::min<uint64_t>(
      options_.max_queued_tokens,
      std::max<uint64_t>(options_.format.chunk_tokens, static_cast<uint64_t>(tokens)));
}

absl::Duration PrefillEngine::TimeFor(uint64_t tokens) const {
  if (tokens_per_second_ <= 0) return absl::ZeroDuration();
  return absl::Seconds(static_cast<double>(tokens) /
                       (tokens_per_second_ * options_.max_concurrent));
}

void PrefillEngine::RecordRate(uint64_t tokens, double seconds) {
  if (tokens == 0 || seconds <= 0) return;
  const double sample = static_cast<double>(tokens) / seconds;
  // A moving average over the last few requests: it follows a machine that slows under load
  // (the measure that matters to the queue) without swinging with each prompt.
  tokens_per_second_ = tokens_per_second_ <= 0 ? sample : 0.8 * tokens_per_second_ + 0.2 * sample;
}

absl::Status PrefillEngine::MeasureThroughput(uint32_t tokens) {
  if (tokens == 0) return absl::InvalidArgumentError("prefill: MeasureThroughput of no tokens");
  const model::ModelConfig& c = model_->config();
  tokens = std::min<uint32_t>(tokens, c.max_position_embeddings - 1);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::KvCache> cache,
                          model_->NewCache(options_.format.CacheOptions()));
  std::vector<uint32_t> prompt(tokens);
  for (uint32_t i = 0; i < tokens; ++i) prompt[i] = (i * 7919u + 13u) % c.vocab_size;
  const auto t0 = std::chrono::steady_clock::now();
  const model::LayerHook hook = [&](uint32_t layer) {
    return cache->CompressLayer(layer).status();
  };
  STRATA_RETURN_IF_ERROR(model_->Prefill(prompt, cache.get(), hook).status());
  const double seconds = Since(t0);
  std::lock_guard<std::mutex> lock(mu_);
  RecordRate(tokens, seconds);
  return absl::OkStatus();
}

PrefillStats PrefillEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

absl::StatusOr<std::shared_ptr<transport::Endpoint>> PrefillEngine::Peer(
    const std::string& address) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(address);
    if (it != peers_.end() && it->second->health().ok()) return it->second;
  }
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<transport::Endpoint> ep,
                          transport_->Connect(address, options_.connect_timeout));
  std::lock_guard<std::mutex> lock(mu_);
  peers_[address] = ep;
  return ep;
}

absl::StatusOr<PrefillResult> PrefillEngine::Prefill(const PrefillRequest& r,
                                                     const std::function<bool()>& cancelled) {
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(transport::ValidateRequestId(r.request_id));
  STRATA_RETURN_IF_ERROR(r.sampling.Validate());
  if (r.top_logprobs > model::kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("prefill: top_logprobs ", r.top_logprobs,
                                                   " is over ", model::kMaxTopLogprobs));
  }
  const model::ModelConfig& c = model_->config();
  if (r.tokens.empty()) return absl::InvalidArgumentError("prefill: the prompt has no tokens");
  if (r.tokens.size() >= c.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill: prompt of ", r.tokens.size(), " tokens, the model's context is ",
                     c.max_position_embeddings));
  }
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    if (r.tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prefill: token ", i, " is ", r.tokens[i],
                                                     ", beyond the vocabulary of ", c.vocab_size));
    }
  }
  // Admission, then a compute slot in arrival order.
  const uint64_t n = r.tokens.size();
  uint64_t ticket;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (load_.queued_tokens + n > options_.max_queued_tokens) {
      ++stats_.refused;
      return absl::ResourceExhaustedError(
          absl::StrCat("prefill: ", load_.queued_tokens, " prompt tokens queued, the limit is ",
                       options_.max_queued_tokens, " (max_queued_tokens); retry later"));
    }
    const uint64_t limit = QueueLimit();
    if (load_.queued_tokens > 0 && load_.queued_tokens + n > limit) {
      ++stats_.refused;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "prefill: %u prompt tokens queued (%.1f s of work at %.0f tokens/s), the limit is %u "
          "(max_queue_time %s); retry later",
          load_.queued_tokens, absl::ToDoubleSeconds(TimeFor(load_.queued_tokens)),
          tokens_per_second_, limit, absl::FormatDuration(options_.max_queue_time)));
    }
    if (r.deadline != absl::InfiniteFuture() && load_.queued_tokens > 0) {
      const absl::Duration wait = TimeFor(load_.queued_tokens + n);
      const absl::Duration left = r.deadline - absl::Now();
      if (wait > left) {
        ++stats_.refused;
        return absl::ResourceExhaustedError(absl::StrFormat(
            "prefill: the request would finish in about %.1f s (%u prompt tokens queued ahead), "
            "after its deadline in %.1f s; retry later or allow more time",
            absl::ToDoubleSeconds(wait), load_.queued_tokens, absl::ToDoubleSeconds(left)));
      }
    }
    load_.queued_tokens += n;
    ++load_.active;
    ++stats_.requests;
    ticket = next_ticket_++;
    // Leaves the queue without computing: gives the turn up when it comes (the next ticket goes
    // then), so the arrival order holds.
    auto leave = [&](absl::Status why, uint64_t* counter) {
      while (ticket != serving_ticket_) turn_cv_.wait_for(lock, std::chrono::milliseconds(5));
      ++serving_ticket_;
      load_.queued_tokens -= n;
      --load_.active;
      ++*counter;
      turn_cv_.notify_all();
      return why;
    };
    while (!(ticket == serving_ticket_ && computing_ < options_.max_concurrent)) {
      turn_cv_.wait_for(lock, std::chrono::milliseconds(20));
      if (cancelled && cancelled()) {
        return leave(absl::CancelledError("prefill: cancelled while queued"), &stats_.cancelled);
      }
      if (absl::Now() > r.deadline) {
        return leave(absl::DeadlineExceededError(
                         "prefill: the request's deadline passed while it was queued"),
                     &stats_.expired);
      }
    }
    ++serving_ticket_;
    ++computing_;
    turn_cv_.notify_all();
  }
  const double queued = Since(t0);
  const auto served_from = std::chrono::steady_clock::now();
  absl::StatusOr<PrefillResult> result = Run(r, cancelled);
  std::lock_guard<std::mutex> lock(mu_);
  --computing_;
  load_.queued_tokens -= n;
  --load_.active;
  turn_cv_.notify_all();
  if (!result.ok()) {
    ++(result.status().code() == absl::StatusCode::kCancelled ? stats_.cancelled : stats_.failed);
    return result;
  }
  RecordRate(n, Since(served_from));
  result->queue_seconds = queued;
  result->total_seconds = Since(t0);
  stats_.prompt_tokens += result->prompt_tokens;
  stats_.cached_tokens += result->cached_tokens;
  stats_.computed_tokens += result->computed_tokens;
  stats_.blocks_shipped += result->blocks_shipped;
  stats_.bytes_shipped += result->bytes_shipped;
  stats_.block_bytes += result->block_bytes;
  stats_.fp16_bytes += result->fp16_bytes;
  stats_.blocks_stored += result->blocks_stored;
  stats_.streamed_early += result->layer0_acked_early > 0;
  return result;
}

absl::StatusOr<PrefillResult> PrefillEngine::Run(const PrefillRequest& r,
                                                 const std::function<bool()>& cancelled) {
  const model::ModelConfig& c = model_->config();
  const uint32_t C = options_.format.chunk_tokens, L = c.num_layers;
  PrefillResult res;
  res.prompt_tokens = static_cast<uint32_t>(r.tokens.size());
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<transport::Endpoint> peer, Peer(r.decode_address));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::KvCache> cache,
                          model_->NewCache(options_.format.CacheOptions()));
  STRATA_ASSIGN_OR_RETURN(PrefixHasher hasher,
                          PrefixHasher::Create(options_.format.KeysFor(r.cache_salt)));
  const std::vector<BlockHash> keys = hasher.ChunkKeys(r.tokens);
  const std::vector<uint64_t> layer_fps = cache->LayerCodecFingerprints();

  // What the decode node gets, kept alive until it has acknowledged it.
  KvShipment ship(sender_.get(), peer, r.request_id);
  const uint64_t chunk_fp16_bytes = uint64_t{C} * c.num_kv_heads * c.head_dim * 2 * 2;
  auto ship_block = [&](uint32_t layer, uint32_t chunk, SharedBytes bytes) {
    return ship.Block(layer, chunk, cache->NameOf(layer, keys[chunk]),
                      chunk > 0 ? std::optional<BlockHash>(keys[chunk - 1]) : std::nullopt,
                      std::move(bytes), chunk_fp16_bytes);
  };

  // The cached prefix: at most every chunk but the one holding the last prompt token.
  uint32_t hit = 0;
  const uint32_t max_hit = static_cast<uint32_t>((r.tokens.size() - 1) / C);
  if (store_ != nullptr && max_hit > 0 && !r.prompt_logprobs) {
    absl::StatusOr<uint32_t> n =
        store_->Lookup(cache->NameOf(0, keys[0]), absl::MakeConstSpan(keys).first(max_hit), layer_fps);
    if (n.ok()) {
      hit = std::min(*n, max_hit);
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.store_lookup_errors;
    }
  }
  // Fetch it; a block gone meanwhile shortens the hit to the chunks fully fetched.
  std::vector<std::vector<SharedBytes>> fetched(hit);
  for (uint32_t k = 0; k < hit; ++k) {
    for (uint32_t l = 0; l < L; ++l) {
      absl::StatusOr<SharedBytes> b = store_->Get(cache->NameOf(l, keys[k]));
      if (!b.ok()) {
        hit = k;
        break;
      }
      fetched[k].push_back(*std::move(b));
    }
  }
  fetched.resize(hit);
  absl::Status adopted;
  for (uint32_t k = 0; k < hit && adopted.ok(); ++k) {
    for (uint32_t l = 0; l < L && adopted.ok(); ++l) {
      adopted = cache->AdoptBlock(l, fetched[k][l], store_->verified_on_get());
    }
  }
  if (!adopted.ok()) {  // a damaged or foreign block from the store: compute it all instead
    Log(r.request_id,
        absl::StrCat("prefill: cached prefix unusable, computing it: ", adopted.ToString()));
    STRATA_ASSIGN_OR_RETURN(cache, model_->NewCache(cache->options()));
    hit = 0;
    fetched.clear();
  }
  STRATA_RETURN_IF_ERROR(cache->CommitAdopted());
  res.cached_tokens = hit * C;
  for (uint32_t k = 0; k < hit; ++k) {
    for (uint32_t l = 0; l < L; ++l) ship_block(l, k, fetched[k][l]);
  }

  // Compute the rest; each layer's new chunk leaves as soon as the layer is done.
  std::vector<uint32_t> next_chunk(L, hit);
  std::vector<std::pair<uint32_t, uint32_t>> computed;  // (layer, chunk) of new blocks
  std::vector<size_t> layer0_transfers;  // the shipment's transfers of computed layer-0 blocks
  const auto tc = std::chrono::steady_clock::now();
  const model::LayerHook hook = [&](uint32_t layer) -> absl::Status {
    if (cancelled && cancelled()) return absl::CancelledError("prefill: cancelled");
    if (!ship.error().ok()) return ship.error();
    if (layer + 1 == L) {
      // Layer streaming, observed: layer-0 blocks the decode node acknowledged (it holds them)
      // before this, the last layer, is compressed.
      uint32_t acked = 0;
      for (size_t i : layer0_transfers) acked += ship.Acknowledged(i);
      res.layer0_acked_early = std::max(res.layer0_acked_early, acked);
    }
    STRATA_ASSIGN_OR_RETURN(std::vector<SharedBytes> blocks, cache->CompressLayer(layer));
    for (SharedBytes& b : blocks) {
      const uint32_t chunk = next_chunk[layer]++;
      computed.emplace_back(layer, chunk);
      const size_t transfer = ship_block(layer, chunk, std::move(b));
      if (layer == 0) layer0_transfers.push_back(transfer);
    }
    return absl::OkStatus();
  };
  model::ComputeBackend::PieceLogits piece_logits = nullptr;
  if (r.prompt_logprobs) {
    const size_t vocab = c.vocab_size;
    piece_logits = [&](size_t first, absl::Span<const float> rows) {
      // Row j's logits predict the token after it (res.cached_tokens is 0 here).
      for (size_t j = 0; j * vocab < rows.size(); ++j) {
        const size_t next = first + j + 1;
        if (next >= r.tokens.size()) break;
        res.prompt_logprobs.push_back(
            model::LogprobsOf(rows.subspan(j * vocab, vocab), r.tokens[next], r.top_logprobs));
      }
    };
  }
  absl::StatusOr<std::vector<float>> logits = model_->Prefill(
      absl::MakeConstSpan(r.tokens).subspan(res.cached_tokens), cache.get(), hook, piece_logits);
  res.compute_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - tc).count();
  if (!logits.ok()) return ship.Abort(logits.status());
  res.computed_tokens = res.prompt_tokens - res.cached_tokens;
  res.first_token = model::Sampler(r.sampling).Sample(*logits, 0, r.tokens);
  if (r.logprobs) {
    res.first_token_logprobs = model::LogprobsOf(*logits, res.first_token, r.top_logprobs);
  }

  // Each layer's window, then the end.
  for (uint32_t l = 0; l < L; ++l) ship.Window(l, cache->ExportWindow(l));
  ship.End({.first_token = res.first_token,
            .prompt_tokens = res.prompt_tokens,
            .chunks = static_cast<uint32_t>(cache->blocks_per_layer()),
            .layers = L,
            .window_tokens = cache->window_tokens(),
            .cached_tokens = res.cached_tokens});
  STRATA_RETURN_IF_ERROR(ship.Finish());
  res.blocks_shipped = ship.blocks();
  res.bytes_shipped = ship.bytes();
  res.block_bytes = ship.block_bytes();
  res.fp16_bytes = ship.fp16_bytes();

  // New chunks to the store, parents first (a store refuses orphans).
  if (store_ != nullptr && options_.put_to_store) {
    std::sort(computed.begin(), computed.end(),
              [](auto a, auto b) { return a.second != b.second ? a.second < b.second : a.first < b.first; });
    std::vector<kvstore::PutItem> items;
    items.reserve(computed.size());
    for (const auto& [layer, chunk] : computed) {
      items.push_back({.name = cache->NameOf(layer, keys[chunk]),
                       .parent = chunk > 0 ? std::optional<BlockHash>(keys[chunk - 1]) : std::nullopt,
                       .block = cache->layer_blocks(layer)[chunk]});
    }
    // One call for all of them (one stream to a remote store, not a round trip per block).
    absl::StatusOr<std::vector<absl::Status>> put = store_->PutMany(items);
    absl::Status failed = put.status();
    if (put.ok()) {
      for (const absl::Status& st : *put) {
        if (absl::IsAlreadyExists(st)) continue;  // another writer's block holds the name
        if (!st.ok()) {
          failed = st;  // the first failure; later chunks of its chain are orphans
          break;
        }
        ++res.blocks_stored;
      }
    }
    if (!failed.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.store_put_errors;
      Log(r.request_id, absl::StrCat("prefill: store Put failed: ", failed.ToString()));
    }
  }
  return res;
}

}  // namespace strata::prefill
