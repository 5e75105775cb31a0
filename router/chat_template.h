// Chat prompt rendering without a Jinja engine (Debian ships none for C++): Strata recognises the
// common template families from the template text and renders messages exactly as those
// templates do with add_generation_prompt=true and no tools.
//
// Families (detection looks for the family's markers in the template text):
//   kLlama3   Llama 3 / 3.0 ("<|start_header_id|>" without a system header of its own):
//             bos_token, then per message "<|start_header_id|>ROLE<|end_header_id|>\n\n" +
//             trim(content) + "<|eot_id|>", then the assistant header.
//   kLlama31  Llama 3.1 / 3.2 / 3.3 (the same markers plus "Cutting Knowledge Date"): bos_token,
//             a system turn "Cutting Knowledge Date: December 2023\nToday Date: DATE\n\n" +
//             trim(first system message or ""), then the other messages as kLlama3. DATE is the
//             template's `set date_string = "..."` default ("26 Jul 2024"), or today when the
//             template asks strftime_now (Llama 3.2).
//   kChatMl   ChatML / Qwen2 ("<|im_start|>"): per message "<|im_start|>ROLE\n" + content +
//             "<|im_end|>\n", then "<|im_start|>assistant\n". When the template carries a
//             literal default system turn (Qwen2's "You are a helpful assistant.") and the first
//             message is not a system message, that turn comes first. No BOS text.
//   kMistral  Mistral v0.3 ("[INST]" ... "[/INST]" without a space before "[/INST]"): bos_token,
//             an optional first system message, then strictly alternating user/assistant turns:
//             user "[INST] " + content + "[/INST]" (the system message is folded into the LAST
//             user turn as "[INST] " + system + "\n\n" + content + "[/INST]", as the v0.3
//             template does), assistant " " + trim(content) + eos_token.
// Anything else is kUnknown: the caller refuses the request (RenderChat returns
// INVALID_ARGUMENT). Older Mistral templates (" [/INST]") are deliberately kUnknown: rendering
// them as v0.3 would be subtly wrong.
//
// trim() strips ASCII whitespace, as Jinja's trim does for the texts these templates see.
// Thread safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace strata::router {

// One chat message after parsing: role is "system", "user" or "assistant" ("developer" is
// parsed as "system"); content is the text (an array of text parts joined with "\n").
struct ChatMessage {
  std::string role;
  std::string content;
};

enum class ChatFamily { kUnknown, kLlama3, kLlama31, kChatMl, kMistral };

// A name for logs: "llama3", "llama3.1", "chatml", "mistral-v0.3", "unknown".
absl::string_view ChatFamilyName(ChatFamily family);

ChatFamily DetectChatFamily(absl::string_view template_text);

// What RenderChat needs beyond the family; AnalyzeChatTemplate fills it from the template text.
struct ChatTemplate {
  ChatFamily family = ChatFamily::kUnknown;
  std::string bos_token;              // kLlama3/kLlama31: "<|begin_of_text|>"; kMistral: "<s>"
  std::string eos_token;              // kMistral: "</s>"
  std::string default_system_prompt;  // kChatMl: the template's literal default system turn
  std::string date_string;            // kLlama31: "26 Jul 2024", or "" = today (strftime_now)
};

// The template's family and parameters with the family's default BOS/EOS texts. INVALID_ARGUMENT
// when the family is unknown or the text is empty.
absl::StatusOr<ChatTemplate> AnalyzeChatTemplate(absl::string_view template_text);

// Renders `messages` with add_generation_prompt. INVALID_ARGUMENT (the message names the
// offending messages[i]) when the template would raise (Mistral: roles not alternating, a system
// message not first) or the family is unknown.
absl::StatusOr<std::string> RenderChat(const ChatTemplate& chat_template,
                                       absl::Span<const ChatMessage> messages);
// The family's defaults (AnalyzeChatTemplate of a canonical template of that family).
absl::StatusOr<std::string> RenderChat(ChatFamily family, absl::Span<const ChatMessage> messages);

// The default chat template text of a tokenizer_config.json: "chat_template" as a string, or the
// entry named "default" of a list of {"name", "template"}. "" when there is none;
// INVALID_ARGUMENT when the JSON is malformed.
absl::StatusOr<std::string> ChatTemplateFromTokenizerConfig(absl::string_view json_text);

}  // namespace strata::router
