#include "router/chat_template.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace strata::router {
namespace {

bool Contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

// Jinja's trim is Python's str.strip(); the texts seen here only differ for non-ASCII spaces.
absl::string_view Trim(absl::string_view s) { return absl::StripAsciiWhitespace(s); }

// Qwen2-style templates spell their default system turn as one literal:
//   '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'
// (with "\n" as the two characters of a Jinja escape, or a real newline). The first occurrence
// whose text is a plain literal (no quotes, no expression) is the default; plain ChatML templates
// build the system turn from message['role'] and have none.
std::string DefaultSystemPrompt(absl::string_view text) {
  constexpr absl::string_view kOpen = "<|im_start|>system";
  size_t pos = 0;
  while ((pos = text.find(kOpen, pos)) != absl::string_view::npos) {
    pos += kOpen.size();
    absl::string_view rest = text.substr(pos);
    if (absl::ConsumePrefix(&rest, "\\n") || absl::ConsumePrefix(&rest, "\n")) {
      const size_t end = rest.find("<|im_end|>");
      if (end == absl::string_view::npos) continue;
      const absl::string_view body = rest.substr(0, end);
      if (!body.empty() && body.find_first_of("'\"{}+") == absl::string_view::npos) {
        return std::string(body);
      }
    }
  }
  return "";
}

// Llama 3.1 writes `{%- set date_string = "26 Jul 2024" %}`; Llama 3.2 asks strftime_now first.
std::string DateString(absl::string_view text) {
  if (Contains(text, "strftime_now")) return "";
  constexpr absl::string_view kSet = "date_string = \"";
  const size_t pos = text.find(kSet);
  if (pos == absl::string_view::npos) return "26 Jul 2024";
  const size_t start = pos + kSet.size();
  const size_t end = text.find('"', start);
  if (end == absl::string_view::npos) return "26 Jul 2024";
  return std::string(text.substr(start, end - start));
}

void AppendLlamaTurn(std::string& out, absl::string_view role, absl::string_view content) {
  absl::StrAppend(&out, "<|start_header_id|>", role, "<|end_header_id|>\n\n", Trim(content),
                  "<|eot_id|>");
}

std::string RenderLlama3(const ChatTemplate& t, absl::Span<const ChatMessage> messages) {
  std::string out = t.bos_token;
  for (const ChatMessage& m : messages) AppendLlamaTurn(out, m.role, m.content);
  out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

std::string RenderLlama31(const ChatTemplate& t, absl::Span<const ChatMessage> messages) {
  absl::string_view system;
  if (!messages.empty() && messages[0].role == "system") {
    system = Trim(messages[0].content);
    messages.remove_prefix(1);
  }
  const std::string date = t.date_string.empty()
                               ? absl::FormatTime("%d %b %Y", absl::Now(), absl::UTCTimeZone())
                               : t.date_string;
  std::string out = t.bos_token;
  absl::StrAppend(&out, "<|start_header_id|>system<|end_header_id|>\n\n",
                  "Cutting Knowledge Date: December 2023\n", "Today Date: ", date, "\n\n", system,
                  "<|eot_id|>");
  for (const ChatMessage& m : messages) AppendLlamaTurn(out, m.role, m.content);
  out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

std::string RenderChatMl(const ChatTemplate& t, absl::Span<const ChatMessage> messages) {
  std::string out;
  if (!t.default_system_prompt.empty() && (messages.empty() || messages[0].role != "system")) {
    absl::StrAppend(&out, "<|im_start|>system\n", t.default_system_prompt, "<|im_end|>\n");
  }
  for (const ChatMessage& m : messages) {
    absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
  }
  out += "<|im_start|>assistant\n";
  return out;
}

absl::StatusOr<std::string> RenderMistral(const ChatTemplate& t,
                                          absl::Span<const ChatMessage> messages) {
  const std::string* system = nullptr;
  size_t first = 0;
  if (!messages.empty() && messages[0].role == "system") {
    system = &messages[0].content;
    first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const bool want_user = (i - first) % 2 == 0;
    if ((messages[i].role == "user") != want_user ||
        (messages[i].role != "user" && messages[i].role != "assistant")) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "messages[%d].role is '%s': this model's chat template (mistral-v0.3) needs an "
          "optional first system message, then alternating user/assistant/user/... turns",
          i, messages[i].role));
    }
  }
  std::string out = t.bos_token;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user") {
      if (i + 1 == messages.size() && system != nullptr) {
        absl::StrAppend(&out, "[INST] ", *system, "\n\n", m.content, "[/INST]");
      } else {
        absl::StrAppend(&out, "[INST] ", m.content, "[/INST]");
      }
    } else {
      absl::StrAppend(&out, " ", Trim(m.content), t.eos_token);
    }
  }
  return out;
}

}  // namespace

absl::string_view ChatFamilyName(ChatFamily family) {
  switch (family) {
    case ChatFamily::kLlama3:
      return "llama3";
    case ChatFamily::kLlama31:
      return "llama3.1";
    case ChatFamily::kChatMl:
      return "chatml";
    case ChatFamily::kMistral:
      return "mistral-v0.3";
    case ChatFamily::kUnknown:
      break;
  }
  return "unknown";
}

ChatFamily DetectChatFamily(absl::string_view text) {
  if (Contains(text, "<|start_header_id|>") && Contains(text, "<|end_header_id|>") &&
      Contains(text, "<|eot_id|>")) {
    return Contains(text, "Cutting Knowledge Date") ? ChatFamily::kLlama31 : ChatFamily::kLlama3;
  }
  if (Contains(text, "<|im_start|>") && Contains(text, "<|im_end|>")) return ChatFamily::kChatMl;
  if (Contains(text, "[INST]") && Contains(text, "[/INST]") && !Contains(text, " [/INST]")) {
    return ChatFamily::kMistral;
  }
  return ChatFamily::kUnknown;
}

absl::StatusOr<ChatTemplate> AnalyzeChatTemplate(absl::string_view text) {
  if (text.empty()) return absl::InvalidArgumentError("the model has no chat template");
  ChatTemplate t;
  t.family = DetectChatFamily(text);
  switch (t.family) {
    case ChatFamily::kLlama3:
      t.bos_token = "<|begin_of_text|>";
      break;
    case ChatFamily::kLlama31:
      t.bos_token = "<|begin_of_text|>";
      t.date_string = DateString(text);
      break;
    case ChatFamily::kChatMl:
      t.default_system_prompt = DefaultSystemPrompt(text);
      break;
    case ChatFamily::kMistral:
      t.bos_token = "<s>";
      t.eos_token = "</s>";
      break;
    case ChatFamily::kUnknown:
      return absl::InvalidArgumentError("the model has a chat template Strata cannot render");
  }
  return t;
}

absl::StatusOr<std::string> RenderChat(const ChatTemplate& t,
                                       absl::Span<const ChatMessage> messages) {
  switch (t.family) {
    case ChatFamily::kLlama3:
      return RenderLlama3(t, messages);
    case ChatFamily::kLlama31:
      return RenderLlama31(t, messages);
    case ChatFamily::kChatMl:
      return RenderChatMl(t, messages);
    case ChatFamily::kMistral:
      return RenderMistral(t, messages);
    case ChatFamily::kUnknown:
      break;
  }
  return absl::InvalidArgumentError("the model has a chat template Strata cannot render");
}

absl::StatusOr<std::string> RenderChat(ChatFamily family, absl::Span<const ChatMessage> messages) {
  ChatTemplate t;
  t.family = family;
  if (family == ChatFamily::kLlama3 || family == ChatFamily::kLlama31) {
    t.bos_token = "<|begin_of_text|>";
    t.date_string = "26 Jul 2024";
  } else if (family == ChatFamily::kMistral) {
    t.bos_token = "<s>";
    t.eos_token = "</s>";
  }
  return RenderChat(t, messages);
}

absl::StatusOr<std::string> ChatTemplateFromTokenizerConfig(absl::string_view json_text) {
  const nlohmann::json config =
      nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError("tokenizer_config.json is not a JSON object");
  }
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const nlohmann::json& entry : *it) {
      if (entry.is_object() && entry.value("name", nlohmann::json()) == "default") {
        const auto tmpl = entry.find("template");
        if (tmpl != entry.end() && tmpl->is_string()) return tmpl->get<std::string>();
      }
    }
    return std::string();
  }
  return absl::InvalidArgumentError(
      "tokenizer_config.json: chat_template must be a string or a list of {name, template}");
}

}  // namespace strata::router
