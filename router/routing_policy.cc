#include "router/routing_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace strata::router {

std::string StoreHolderId(const std::string& address, const std::string& cluster_store) {
  return address == cluster_store ? std::string("store") : absl::StrCat("store@", address);
}
namespace {

bool ValidWeight(double w) { return std::isfinite(w) && w >= 0; }

// Costs this close to the minimum are ties (the arithmetic is on small integers times
// weights, so only rounding separates equal costs).
bool NearlyEqual(double a, double b) {
  return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b));
}

std::string Reasons(absl::Span<const PrefillCandidate> p) {
  std::vector<std::string> parts;
  for (const PrefillCandidate& c : p) parts.push_back(absl::StrCat(c.id, ": ", c.skipped));
  return absl::StrJoin(parts, "; ");
}

std::string Reasons(absl::Span<const DecodeCandidate> d) {
  std::vector<std::string> parts;
  for (const DecodeCandidate& c : d) parts.push_back(absl::StrCat(c.id, ": ", c.skipped));
  return absl::StrJoin(parts, "; ");
}

}  // namespace

const char* NodeRoleName(NodeRole role) {
  switch (role) {
    case NodeRole::kPrefill:
      return "prefill";
    case NodeRole::kDecode:
      return "decode";
  }
  return "invalid";
}

absl::Status RoutingOptions::Validate() const {
  for (double w : {device_hit_weight, ram_hit_weight, disk_hit_weight, store_hit_weight,
                   active_request_weight, temperature}) {
    if (!ValidWeight(w)) {
      return absl::InvalidArgumentError("routing weights and temperature must be finite, >= 0");
    }
  }
  if (busy_prefill_tokens != 0 && max_queued_prefill_tokens != 0 &&
      busy_prefill_tokens > max_queued_prefill_tokens) {
    return absl::InvalidArgumentError("busy_prefill_tokens > max_queued_prefill_tokens");
  }
  return absl::OkStatus();
}

std::string RouteDecision::Explain() const {
  std::string out = absl::StrFormat(
      "prefill=%s decode=%s chunks=%u cached=%u(local %u + store %u) uncached_tokens=%u "
      "decode_kv_bytes=%u | P:",
      prefill_id, decode_id, chain_chunks, expected_cached_chunks(), local_chunks, store_chunks,
      uncached_tokens, decode_kv_bytes);
  for (const PrefillCandidate& c : prefill_candidates) {
    if (!c.skipped.empty()) {
      absl::StrAppend(&out, " ", c.id, "=skip(", c.skipped, ")");
      continue;
    }
    absl::StrAppendFormat(&out, " %s%s=%.2f[raw %.2f credit %.2f local %u(d%u r%u k%u) store %u]",
                          c.id == prefill_id ? "*" : "", c.id, c.cost, c.raw, c.credit,
                          c.local_chunks, c.tier_chunks[0], c.tier_chunks[1], c.tier_chunks[2],
                          c.store_chunks);
  }
  absl::StrAppend(&out, " | D:");
  for (const DecodeCandidate& c : decode_candidates) {
    if (!c.skipped.empty()) {
      absl::StrAppend(&out, " ", c.id, "=skip(", c.skipped, ")");
      continue;
    }
    absl::StrAppendFormat(&out, " %s%s=%.3f[kv %.3f batch %.3f]", c.id == decode_id ? "*" : "",
                          c.id, c.load, c.kv_fraction, c.batch_fraction);
  }
  return out;
}

RoutingPolicy::RoutingPolicy(RoutingOptions options)
    : options_(std::move(options)), rng_(options_.seed) {}

absl::StatusOr<std::unique_ptr<RoutingPolicy>> RoutingPolicy::Create(RoutingOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::unique_ptr<RoutingPolicy>(new RoutingPolicy(std::move(options)));
}

size_t RoutingPolicy::Pick(absl::Span<const double> costs, absl::Span<const size_t> eligible,
                           double temperature) const {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  for (size_t i : eligible) {
    lo = std::min(lo, costs[i]);
    hi = std::max(hi, costs[i]);
  }
  std::lock_guard lock(rng_mu_);
  if (temperature > 0 && !NearlyEqual(hi, lo)) {
    std::vector<double> weights;
    weights.reserve(eligible.size());
    for (size_t i : eligible)
      weights.push_back(std::exp(-(costs[i] - lo) / ((hi - lo) * temperature)));
    std::discrete_distribution<size_t> draw(weights.begin(), weights.end());
    return eligible[draw(rng_)];
  }
  // Argmin with a uniform tie-break (reservoir over the ties): a fixed order would send every
  // tie to the same node (Dynamo PR #6253).
  size_t chosen = eligible.front();
  size_t ties = 0;
  for (size_t i : eligible) {
    if (!NearlyEqual(costs[i], lo)) continue;
    ++ties;
    if (std::uniform_int_distribution<size_t>(0, ties - 1)(rng_) == 0) chosen = i;
  }
  return chosen;
}

absl::StatusOr<RouteDecision> RoutingPolicy::Route(const RouteRequest& request,
                                                   const OverlapResult& overlap,
                                                   absl::Span<const NodeLoad> nodes) const {
  if (request.prompt_tokens == 0 || request.chunk_tokens == 0) {
    return absl::InvalidArgumentError("prompt_tokens and chunk_tokens must be >= 1");
  }
  const double chunk = request.chunk_tokens;
  const uint32_t chain_chunks = static_cast<uint32_t>(std::min<uint64_t>(
      request.prompt_tokens / request.chunk_tokens, std::numeric_limits<uint32_t>::max()));
  const uint32_t store = std::min(overlap.StoreChunks(), chain_chunks);

  RouteDecision d;
  d.chain_chunks = chain_chunks;
  d.decode_kv_bytes = request.decode_kv_bytes;

  // ---- prefill ----
  std::vector<size_t> prefill_nodes;  // indices into `nodes`
  std::vector<double> costs;          // by position in d.prefill_candidates
  std::vector<size_t> fit, not_busy;  // positions in d.prefill_candidates
  bool any_healthy_prefill = false;
  for (size_t n = 0; n < nodes.size(); ++n) {
    const NodeLoad& node = nodes[n];
    if (node.role != NodeRole::kPrefill) continue;
    PrefillCandidate& c = d.prefill_candidates.emplace_back();
    prefill_nodes.push_back(n);
    c.id = node.id;
    if (const HolderOverlap* local = overlap.Find(node.id); local != nullptr) {
      c.local_chunks = std::min(local->chunks, chain_chunks);
      std::copy(std::begin(local->tier_chunks), std::end(local->tier_chunks),
                std::begin(c.tier_chunks));
    }
    uint32_t readable = store;  // leading chunks in the stores this node reads
    if (!node.store_holder.empty()) {
      readable = 0;
      for (absl::string_view holder :
           {absl::string_view(node.store_holder), absl::string_view(kSharedTierHolder)}) {
        if (const HolderOverlap* h = overlap.Find(holder); h != nullptr) {
          readable = std::max(readable, std::min(h->chunks, chain_chunks));
        }
      }
    }
    c.store_chunks = node.reads_store && readable > c.local_chunks ? readable - c.local_chunks : 0;
    const uint64_t cached_tokens =
        (uint64_t{c.local_chunks} + c.store_chunks) * request.chunk_tokens;
    c.uncached_tokens =
        request.prompt_tokens > cached_tokens ? request.prompt_tokens - cached_tokens : 0;
    c.raw = (static_cast<double>(node.queued_prefill_tokens) + request.prompt_tokens) / chunk;
    c.credit =
        options_.device_hit_weight * c.tier_chunks[0] + options_.ram_hit_weight * c.tier_chunks[1] +
        options_.disk_hit_weight * c.tier_chunks[2] + options_.store_hit_weight * c.store_chunks;
    c.cost =
        std::max(0.0, c.raw - c.credit) + options_.active_request_weight * node.active_requests;
    costs.push_back(c.cost);
    if (!node.healthy) {
      c.skipped = "unhealthy";
      continue;
    }
    any_healthy_prefill = true;
    if (options_.max_queued_prefill_tokens != 0 &&
        node.queued_prefill_tokens + c.uncached_tokens > options_.max_queued_prefill_tokens) {
      c.skipped = absl::StrCat("queue ", node.queued_prefill_tokens, "+", c.uncached_tokens, " > ",
                               options_.max_queued_prefill_tokens);
      continue;
    }
    // The node's own bound counts prompt tokens, as its queue does.
    if (node.max_queued_prefill_tokens != 0 && node.queued_prefill_tokens > 0 &&
        node.queued_prefill_tokens + request.prompt_tokens > node.max_queued_prefill_tokens) {
      c.skipped = absl::StrCat("queue full ", node.queued_prefill_tokens, "+",
                               request.prompt_tokens, " > ", node.max_queued_prefill_tokens);
      continue;
    }
    fit.push_back(d.prefill_candidates.size() - 1);
    if (options_.busy_prefill_tokens == 0 ||
        node.queued_prefill_tokens <= options_.busy_prefill_tokens) {
      not_busy.push_back(d.prefill_candidates.size() - 1);
    }
  }

  // ---- decode ----
  std::vector<double> loads;
  std::vector<size_t> decode_fit, decode_not_full;  // indices into d.decode_candidates
  bool any_healthy_decode = false;
  for (const NodeLoad& node : nodes) {
    if (node.role != NodeRole::kDecode) continue;
    DecodeCandidate& c = d.decode_candidates.emplace_back();
    c.id = node.id;
    const uint64_t kv_after =
        node.kv_bytes_in_use + node.kv_bytes_reserved + request.decode_kv_bytes;
    if (node.kv_bytes_capacity > 0) {
      c.kv_fraction = static_cast<double>(kv_after) / static_cast<double>(node.kv_bytes_capacity);
    }
    if (node.max_batch > 0) {
      c.batch_fraction = (node.active_requests + 1.0) / node.max_batch;
    }
    c.load = std::max(c.kv_fraction, c.batch_fraction);
    loads.push_back(c.load);
    if (!node.healthy) {
      c.skipped = "unhealthy";
      continue;
    }
    any_healthy_decode = true;
    if (node.kv_bytes_capacity == 0) {
      c.skipped = "no kv capacity reported";
    } else if (kv_after > node.kv_bytes_capacity) {
      c.skipped = absl::StrCat("kv ", kv_after, " > ", node.kv_bytes_capacity);
    } else if (node.max_waiting != 0 && node.max_batch != 0 &&
               node.active_requests >= node.max_batch + node.max_waiting) {
      c.skipped = absl::StrCat("queue full ", node.active_requests, " >= ", node.max_batch, "+",
                               node.max_waiting);
    } else {
      decode_fit.push_back(d.decode_candidates.size() - 1);
      if (node.max_batch == 0 || node.active_requests < node.max_batch) {
        decode_not_full.push_back(d.decode_candidates.size() - 1);
      }
    }
  }

  if (!any_healthy_prefill) {
    return absl::UnavailableError(
        d.prefill_candidates.empty()
            ? "no prefill node"
            : absl::StrCat("no healthy prefill node: ", Reasons(d.prefill_candidates)));
  }
  if (!any_healthy_decode) {
    return absl::UnavailableError(
        d.decode_candidates.empty()
            ? "no decode node"
            : absl::StrCat("no healthy decode node: ", Reasons(d.decode_candidates)));
  }
  if (fit.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(kNoPrefillRoom, ": ", Reasons(d.prefill_candidates)));
  }
  if (decode_fit.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(kNoDecodeRoom, ": ", Reasons(d.decode_candidates)));
  }

  // Busy nodes stay out while another node can take the request; when all are busy, the
  // request still goes somewhere (a 429 only when a node truly cannot take it, as Dynamo).
  const std::vector<size_t>& prefill_pool = not_busy.empty() ? fit : not_busy;
  if (!not_busy.empty()) {
    for (size_t i : fit) {
      if (std::find(not_busy.begin(), not_busy.end(), i) == not_busy.end()) {
        d.prefill_candidates[i].skipped =
            absl::StrCat("busy ", nodes[prefill_nodes[i]].queued_prefill_tokens, " > ",
                         options_.busy_prefill_tokens);
      }
    }
  }
  const size_t p = Pick(costs, prefill_pool, options_.temperature);
  const PrefillCandidate& chosen = d.prefill_candidates[p];
  d.prefill_id = chosen.id;
  d.local_chunks = chosen.local_chunks;
  d.store_chunks = chosen.store_chunks;
  d.uncached_tokens = chosen.uncached_tokens;
  d.prefill_cost = chosen.cost;

  // A full batch is no refusal: the decode node queues the sequence (up to its own limit, past
  // which it answers RESOURCE_EXHAUSTED) and runs it as others finish. Such nodes are passed over
  // while another has room in its batch.
  if (!decode_not_full.empty()) {
    for (size_t i : decode_fit) {
      if (std::find(decode_not_full.begin(), decode_not_full.end(), i) == decode_not_full.end()) {
        const NodeLoad& node = *std::find_if(nodes.begin(), nodes.end(), [&](const NodeLoad& n) {
          return n.role == NodeRole::kDecode && n.id == d.decode_candidates[i].id;
        });
        d.decode_candidates[i].skipped =
            absl::StrCat("batch full ", node.active_requests, "/", node.max_batch);
      }
    }
  }
  const size_t q = Pick(loads, decode_not_full.empty() ? decode_fit : decode_not_full,
                        /*temperature=*/0);
  d.decode_id = d.decode_candidates[q].id;
  d.decode_load = d.decode_candidates[q].load;
  return d;
}

// ---- LoadTracker ----

absl::Status LoadTracker::Add(absl::string_view request_id, const RouteDecision& decision,
                              absl::Time now) {
  if (request_id.empty() || decision.prefill_id.empty() || decision.decode_id.empty()) {
    return absl::InvalidArgumentError("request id, prefill_id and decode_id must be set");
  }
  std::lock_guard lock(mu_);
  if (requests_.contains(request_id)) {
    return absl::AlreadyExistsError(absl::StrCat("request '", request_id, "' already tracked"));
  }
  Request r;
  r.prefill_id = decision.prefill_id;
  r.decode_id = decision.decode_id;
  r.key = ShareKey(now, next_sequence_++);
  nodes_[r.prefill_id].prefill.emplace(r.key, Share{decision.uncached_tokens, 0});
  nodes_[r.decode_id].decode.emplace(r.key, Share{0, decision.decode_kv_bytes});
  requests_.emplace(std::string(request_id), std::move(r));
  return absl::OkStatus();
}

void LoadTracker::DropPrefill(const Request& r) {
  auto it = nodes_.find(r.prefill_id);
  if (it == nodes_.end()) return;
  it->second.prefill.erase(r.key);
  if (it->second.prefill.empty() && it->second.decode.empty()) nodes_.erase(it);
}

void LoadTracker::DropDecode(const Request& r) {
  auto it = nodes_.find(r.decode_id);
  if (it == nodes_.end()) return;
  it->second.decode.erase(r.key);
  if (it->second.prefill.empty() && it->second.decode.empty()) nodes_.erase(it);
}

bool LoadTracker::MarkPrefillDone(absl::string_view request_id) {
  std::lock_guard lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second.prefill_done) return false;
  DropPrefill(it->second);
  it->second.prefill_done = true;
  return true;
}

bool LoadTracker::Complete(absl::string_view request_id) {
  std::lock_guard lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  if (!it->second.prefill_done) DropPrefill(it->second);
  DropDecode(it->second);
  requests_.erase(it);
  return true;
}

size_t LoadTracker::Forget(absl::Time cutoff) {
  std::lock_guard lock(mu_);
  size_t dropped = 0;
  for (auto it = requests_.begin(); it != requests_.end();) {
    if (it->second.key.first < cutoff) {
      if (!it->second.prefill_done) DropPrefill(it->second);
      DropDecode(it->second);
      requests_.erase(it++);
      ++dropped;
    } else {
      ++it;
    }
  }
  return dropped;
}

void LoadTracker::Overlay(absl::Span<NodeLoad> nodes) const {
  std::lock_guard lock(mu_);
  // Shares routed at or before the report may already be in it; those strictly after cannot be.
  for (NodeLoad& node : nodes) {
    auto it = nodes_.find(node.id);
    if (it == nodes_.end()) continue;
    const ShareKey after(node.reported_at, std::numeric_limits<uint64_t>::max());
    const std::map<ShareKey, Share>& shares =
        node.role == NodeRole::kPrefill ? it->second.prefill : it->second.decode;
    for (auto s = shares.upper_bound(after); s != shares.end(); ++s) {
      node.queued_prefill_tokens += s->second.tokens;
      node.kv_bytes_reserved += s->second.kv_bytes;
      ++node.active_requests;
    }
  }
}

size_t LoadTracker::in_flight() const {
  std::lock_guard lock(mu_);
  return requests_.size();
}

}  // namespace strata::router
