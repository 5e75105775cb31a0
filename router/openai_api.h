// The OpenAI-compatible wire format of the router: request parsing/validation and response
// rendering for POST /v1/completions, POST /v1/chat/completions and GET /v1/models. Pure
// functions without I/O (fuzzed by tests/fuzz/openai_request_fuzz.cc); thread-safe.
//
// Validation follows OpenAI / vLLM: every error is INVALID_ARGUMENT whose message names the field
// ("max_tokens must be >= 1, got 0", "messages[2].content must be a string or an array of text
// parts"); ErrorParam() gives that field for the error's "param". Unknown fields are ignored
// whatever their type; known fields of the wrong type are refused. Features Strata does not
// implement are refused rather than silently ignored: n != 1, best_of != 1, echo, logprobs,
// top_logprobs, suffix, logit_bias, non-zero presence/frequency penalties, tools, function
// calling, response_format other than "text".
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "router/backend.h"
#include "router/chat_template.h"

namespace strata::router {

enum class Endpoint { kCompletions, kChatCompletions };

// Hard cap on max_tokens / max_completion_tokens; the backend checks against the context.
inline constexpr uint32_t kMaxTokensCap = 1u << 20;

// Renders parsed chat messages into a prompt for `model` (the HTTP layer: the model's chat
// template via chat_template.h). Its errors are returned by ParseCompletionRequest unchanged
// (e.g. NOT_FOUND for an unknown model, INVALID_ARGUMENT for a template Strata cannot render).
using ChatRenderer = std::function<absl::StatusOr<std::string>(
    const std::string& model, absl::Span<const ChatMessage> messages)>;

// Parses and validates a request body. For kChatCompletions `render_chat` must be set and is
// called once with the validated messages (after every other field was validated); for
// kCompletions it is not used (may be empty). request_id and arrival are left for the caller.
// Returns INVALID_ARGUMENT for a malformed body (JSON errors carry the byte position).
absl::StatusOr<CompletionRequest> ParseCompletionRequest(absl::string_view body, Endpoint endpoint,
                                                         const ChatRenderer& render_chat);

// The field an INVALID_ARGUMENT from ParseCompletionRequest is about ("temperature",
// "messages[2].content"), if any.
std::optional<std::string> ErrorParam(const absl::Status& status);
// Returns InvalidArgumentError(message) carrying `param` for ErrorParam.
absl::Status FieldError(absl::string_view param, absl::string_view message);
// Overload refusals (RESOURCE_EXHAUSTED) carry when to try again: the HTTP layer's Retry-After
// header (whole seconds, >= 1; 1 when the status carries none).
absl::Status WithRetryAfter(absl::Status status, int seconds);
int RetryAfterSeconds(const absl::Status& status);

// An error as the OpenAI API returns it: HTTP status and the "error" object.
struct ApiError {
  int http_status = 500;
  std::string message;
  std::string type;                  // "invalid_request_error", "not_found_error", ...
  std::optional<std::string> param;  // the offending field, or null
  std::optional<std::string> code;   // e.g. "rate_limit_exceeded", or null
  int retry_after_seconds = 0;       // 429: the Retry-After header
};

// Status mapping: INVALID_ARGUMENT 400, NOT_FOUND 404, OUT_OF_RANGE (body too large) 413,
// RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, others 500. `status` is not OK.
ApiError ToApiError(const absl::Status& status);
// {"error":{"message":..,"type":..,"param":..,"code":..}}
std::string RenderErrorJson(const ApiError& error);

// What every response object of one request repeats.
struct ResponseContext {
  std::string id;  // CompletionRequest::request_id
  std::string model;
  int64_t created = 0;  // Unix seconds of the request's arrival
  bool chat = false;
  bool include_usage = false;  // streaming: "usage": null on every chunk but the usage chunk
  bool logprobs = false;       // choices carry a logprobs object (else "logprobs": null)
};

// The most choices ("n") a request may ask for.
inline constexpr uint32_t kMaxChoices = 16;

// The most top logprobs a request may ask for (OpenAI's chat limit; model/logprobs.h's too).
inline constexpr uint32_t kMaxTopLogprobs = 20;

// The "system_fingerprint" of every response object.
inline constexpr absl::string_view kSystemFingerprint = "fp_strata";

// Non-streaming body: "text_completion" (choices[0].text) or "chat.completion"
// (choices[0].message {role assistant, content}) with usage {prompt_tokens, completion_tokens,
// total_tokens, prompt_tokens_details {cached_tokens}}.
// With ctx.logprobs, choices[0].logprobs holds `logprobs` (one per token of `text`; OpenAI's
// completions or chat shape).
std::string RenderCompletionResponse(const ResponseContext& ctx, absl::string_view text,
                                     FinishReason reason, const Usage& usage,
                                     absl::Span<const TokenLogprobs> logprobs = {});
// The same with n choices (index = position).
struct ChoiceResult {
  std::string text;
  FinishReason reason = FinishReason::kStop;
  std::vector<TokenLogprobs> logprobs;
};
std::string RenderCompletionResponse(const ResponseContext& ctx,
                                     absl::Span<const ChoiceResult> choices, const Usage& usage);

// Server-sent events, each "data: <json>\n\n".
// Chat only: the first chunk, delta {role: "assistant", content: ""}.
std::string RenderStreamRoleEvent(const ResponseContext& ctx);
// A chunk carrying generated text (text / delta.content), finish_reason null; with
// ctx.logprobs, the logprobs of its tokens (completions' text_offset counted from
// `text_offset`).
std::string RenderStreamTextEvent(const ResponseContext& ctx, absl::string_view text,
                                  absl::Span<const TokenLogprobs> logprobs = {},
                                  size_t text_offset = 0, uint32_t index = 0);
// The last choice chunk: empty text / empty delta and finish_reason.
std::string RenderStreamFinishEvent(const ResponseContext& ctx, FinishReason reason,
                                    uint32_t index = 0);
// With include_usage: choices [] and the usage object.
std::string RenderStreamUsageEvent(const ResponseContext& ctx, const Usage& usage);
// A failure while streaming: data: {"error":{...}}.
std::string RenderStreamErrorEvent(const ApiError& error);
inline constexpr absl::string_view kStreamDoneEvent = "data: [DONE]\n\n";

// {"object":"list","data":[{"id","object":"model","created","owned_by","max_model_len"}]}
std::string RenderModelList(const std::vector<ModelCard>& models);

absl::string_view FinishReasonName(FinishReason reason);  // "stop" / "length"

}  // namespace strata::router
