// libFuzzer target for the router's OpenAI request parser: any bytes, as a completions body and
// as a chat body (rendered with each chat template family), must parse or be refused with
// INVALID_ARGUMENT naming the problem; never crash. Whatever is accepted must hold the
// documented invariants.
#include <cstddef>
#include <cstdint>
#include <string>

#include "router/chat_template.h"
#include "router/openai_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::router;
  const absl::string_view body(reinterpret_cast<const char*>(data), size);
  const ChatFamily family = static_cast<ChatFamily>(size % 5);  // every family, unknown too
  const ChatRenderer render = [family](const std::string&, absl::Span<const ChatMessage> messages) {
    return RenderChat(family, messages);
  };
  for (Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(body, endpoint, render);
    if (!r.ok()) {
      if (r.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
      if (r.status().message().empty()) __builtin_trap();
      (void)RenderErrorJson(ToApiError(r.status()));
      continue;
    }
    const SamplingParams& s = r->sampling;
    if (r->model.empty() || s.temperature < 0 || s.temperature > 2 || s.top_p <= 0 || s.top_p > 1 ||
        s.max_tokens > kMaxTokensCap || s.stop.size() > 4 ||
        (endpoint == Endpoint::kCompletions && s.max_tokens == 0) ||
        (!r->prompt_tokens.empty() && !r->prompt_text.empty()) ||
        (r->include_usage && !r->stream)) {
      __builtin_trap();
    }
    const ResponseContext ctx{"cmpl-fuzz", r->model, 0, r->chat, r->include_usage};
    (void)RenderCompletionResponse(ctx, r->prompt_text, FinishReason::kStop, Usage{});
    (void)RenderStreamTextEvent(ctx, r->prompt_text);
  }
  return 0;
}
