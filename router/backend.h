// The seam between the router's OpenAI-compatible HTTP front (http_server.h) and the cluster
// that serves completions. The HTTP layer parses and validates requests (openai_api.h), renders
// chat prompts (chat_template.h) and hands a CompletionRequest to a Backend; the backend answers
// through a CompletionStream the HTTP layer implements.
//
// Threading and lifetime contract (what an implementation of Backend must honour):
//   - Backend methods are called from the HTTP server's I/O threads, concurrently; they must be
//     thread-safe and must not block for long (no waiting on generation inside Start).
//   - CompletionStream calls come from any backend thread, one at a time per stream (the backend
//     serializes them), in order: Token* then exactly one of Finish or Fail. They never block:
//     the HTTP layer copies what it needs and queues the write on the connection.
//   - The backend keeps the shared_ptr<CompletionStream> as long as it may still call it and
//     should drop it after Finish / Fail or once the request was cancelled.
//   - RequestHandle: destroying it or calling Cancel cancels the request (the client went away,
//     or the server is stopping). The HTTP layer calls Cancel (or destroys the handle) from an I/O
//     thread, possibly while the backend is inside a CompletionStream call on another thread:
//     the backend must not take a lock in Cancel that it holds across stream calls in a way that
//     deadlocks, and must not call the stream from inside Cancel. After Cancel no further stream
//     calls are required; calls that still arrive (a race with Cancel) are accepted and ignored.
//   - The HTTP layer destroys each RequestHandle once its request has finished (after Finish or
//     Fail reached the connection), so destroying a handle of a finished request must be a no-op.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace strata::router {

struct SamplingParams {
  float temperature = 1.0f;      // OpenAI default; 0 = greedy. Validated to [0, 2].
  float top_p = 1.0f;            // (0, 1]
  uint32_t top_k = 0;            // 0: off (vLLM extension field "top_k"; -1 from vLLM clients = 0)
  std::optional<uint64_t> seed;  // OpenAI "seed" (an int64; negative seeds keep their bits)
  // Completions default 16; chat default: the rest of the context (backend decides; 0 = "unset").
  // Otherwise in [1, kMaxTokensCap] (openai_api.h); the backend checks it against the context.
  uint32_t max_tokens = 16;
  std::vector<std::string> stop;  // up to 4 non-empty stop strings, valid UTF-8
  bool ignore_eos = false;  // vLLM extension "ignore_eos": generate max_tokens (benchmarks)
  // OpenAI's penalties over the generated tokens ([-2, 2]), vLLM's repetition penalty over the
  // prompt and generated tokens ((0, 100], 1 = off) and min_p ([0, 1]): model/sampler.h.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  float min_p = 0.0f;
};

struct CompletionRequest {
  // "cmpl-<32 hex>" / "chatcmpl-<32 hex>", minted by the HTTP layer (random, unique); also the
  // X-Request-Id response header and the "id" of every response object.
  std::string request_id;
  std::string model;
  bool chat = false;
  // The rendered chat prompt, or the completions prompt string. A rendered chat prompt already
  // holds the template's BOS text (e.g. "<|begin_of_text|>"): tokenize it with special tokens
  // recognised and without adding another BOS (as vLLM does for chat).
  std::string prompt_text;
  // When the completions prompt was given as token ids (then prompt_text is empty). Non-empty.
  std::vector<uint32_t> prompt_tokens;
  SamplingParams sampling;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage (only with stream)
  // Completions: the response's text starts with the prompt's (with logprobs: the prompt's
  // tokens and their logprobs first, the first one's null).
  bool echo = false;
  // Each generated token's logprobs, and those of the top_logprobs (<= 20) most likely tokens
  // (completions: "logprobs": N; chat: "logprobs": true, "top_logprobs": N).
  bool logprobs = false;
  uint32_t top_logprobs = 0;
  // Choices ("n"), each sampled on its own (seeds seed, seed + 1, ...) over one computation of
  // the prompt: CompletionStream::Choice gives each its stream.
  uint32_t n = 1;
  std::string cache_salt;      // vLLM extension "cache_salt": tenants with different salts never
                               // share KV ("" = no salt)
  absl::Time arrival;          // when the HTTP layer finished reading the request
  // The client's deadline, from arrival (the X-Request-Timeout header); zero: the backend's own.
  // Every node gives the request up when it passes (504 before the first token).
  absl::Duration timeout = absl::ZeroDuration();
};

enum class FinishReason { kStop, kLength };

// One token's log-probability, for OpenAI's `logprobs`.
struct LogprobEntry {
  std::string token;  // the token's bytes (a token may hold part of a UTF-8 character)
  float logprob = 0;
};
struct TokenLogprobs {
  LogprobEntry chosen;            // the token that was generated (or the prompt's token)
  std::vector<LogprobEntry> top;  // the most likely tokens, most likely first
  bool known = true;              // false for a prompt's first token: nothing predicts it
};

struct Usage {
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

// Implemented by the HTTP layer; see the threading contract at the top of this file.
class CompletionStream {
 public:
  virtual ~CompletionStream() = default;
  // One generated token. `text` is complete UTF-8 (may be empty: nothing is sent for it while
  // streaming); a backend holding back an incomplete UTF-8 sequence sends it with a later token.
  virtual void Token(std::string_view text, uint32_t token_id) = 0;
  // The same for a request that asked for logprobs: every token comes this way (its text may be
  // empty), with its logprobs. The default drops them.
  virtual void TokenWithLogprobs(std::string_view text, uint32_t token_id,
                                 const TokenLogprobs& logprobs) {
    (void)logprobs;
    Token(text, token_id);
  }
  // Completions with echo: the prompt's text (and with logprobs its tokens' logprobs), once,
  // before the first token. The default drops it.
  virtual void Echo(std::string_view prompt_text, std::vector<TokenLogprobs> prompt_logprobs) {
    (void)prompt_text;
    (void)prompt_logprobs;
  }
  virtual void Finish(FinishReason reason, const Usage& usage) = 0;
  // Ends the request with an error. Before any byte was sent (non-streaming, or streaming before
  // the first token) it becomes the HTTP status (INVALID_ARGUMENT 400, NOT_FOUND 404,
  // RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, others 500; a
  // RESOURCE_EXHAUSTED status's WithRetryAfter payload gives the Retry-After header); once a stream
  // has sent a token, one SSE `data: {"error":...}` event, then the connection closes.
  virtual void Fail(const absl::Status& status) = 0;
  // n > 1: the stream of choice `index` (< n): its calls are that choice's; its Finish ends the
  // choice (with the choice's usage) and the request ends once every choice has; a Fail on any
  // fails the request. Calls to the parent stream itself are choice 0's. Null where the HTTP
  // layer does not support choices (the default).
  virtual std::shared_ptr<CompletionStream> Choice(uint32_t index) {
    (void)index;
    return nullptr;
  }
};

// Returned by Backend::Start; destroying it or calling Cancel cancels the request (client gone):
// the backend frees its resources; no further stream calls are required after Cancel.
class RequestHandle {
 public:
  virtual ~RequestHandle() = default;
  virtual void Cancel() = 0;
};

struct ModelCard {
  std::string id;
  int64_t created = 0;  // Unix seconds
  std::string owned_by = "strata";
  uint32_t max_model_len = 0;  // context length in tokens
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::vector<ModelCard> Models() const = 0;
  // The chat template text of `model` (from its tokenizer_config.json; see
  // ChatTemplateFromTokenizerConfig in chat_template.h), "" if it has none or `model` is unknown.
  virtual std::string ChatTemplateText(const std::string& model) const = 0;
  // Starts a request, or refuses it: INVALID_ARGUMENT (400, e.g. prompt over the context: the
  // message names the field), NOT_FOUND (404 unknown model), RESOURCE_EXHAUSTED (429 +
  // Retry-After header, overloaded queue), UNAVAILABLE (503). On OK the backend owns the request
  // and will call `stream` (possibly before Start returns, from the calling thread).
  virtual absl::StatusOr<std::unique_ptr<RequestHandle>> Start(
      CompletionRequest request, std::shared_ptr<CompletionStream> stream) = 0;
  // GET /health: 200 {"status":"ok"} when true, else 503 with *detail as the message.
  virtual bool Healthy(std::string* detail) const = 0;
  // GET /metrics: Prometheus text format 0.0.4.
  virtual std::string RenderMetrics() const = 0;
};

}  // namespace strata::router
