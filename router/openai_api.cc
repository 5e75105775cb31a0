#include "router/openai_api.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"

namespace strata::router {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

constexpr absl::string_view kParamPayload = "type.strata.dev/router.param";
constexpr absl::string_view kRetryAfterPayload = "type.strata.dev/router.retry_after_seconds";
// Stands in for each byte of invalid UTF-8 so that the JSON still parses and the walk below can
// name the field holding it. U+FFFF is a noncharacter: well-formed, and not seen in real text
// (a body holding it as well as invalid bytes may have the wrong field named; it is refused
// either way).
constexpr char kBadByteMarker[] = "\xEF\xBF\xBF";
constexpr int kMaxWalkDepth = 128;

// Finds the first string (key or value) holding kBadByteMarker; fills *path with its field path.
bool FindMarker(const json& value, const std::string& path, int depth, std::string* found) {
  if (depth > kMaxWalkDepth) return false;
  if (value.is_string()) {
    if (value.get_ref<const std::string&>().find(kBadByteMarker) != std::string::npos) {
      *found = path;
      return true;
    }
    return false;
  }
  if (value.is_object()) {
    for (const auto& [key, member] : value.items()) {
      const std::string child = path.empty() ? key : absl::StrCat(path, ".", key);
      if (key.find(kBadByteMarker) != std::string::npos) {
        *found = path.empty() ? "(a field name)" : absl::StrCat(path, " (a field name)");
        return true;
      }
      if (FindMarker(member, child, depth + 1, found)) return true;
    }
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i) {
      if (FindMarker(value[i], absl::StrCat(path, "[", i, "]"), depth + 1, found)) return true;
    }
  }
  return false;
}

absl::StatusOr<json> ParseJson(absl::string_view body) {
  try {
    return json::parse(body);
  } catch (const json::parse_error& e) {
    absl::string_view what = e.what();
    if (const size_t bracket = what.find("] "); bracket != absl::string_view::npos) {
      what.remove_prefix(bracket + 2);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("request body is not valid JSON (at byte ", e.byte, "): ", what));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("request body is not valid JSON: ", e.what()));
  }
}

absl::StatusOr<json> ParseBody(absl::string_view body) {
  size_t bad = 0;
  if (IsValidUtf8(body, &bad)) return ParseJson(body);
  const size_t first_bad = bad;
  std::string sanitized;
  sanitized.reserve(body.size() + 16);
  absl::string_view rest = body;
  size_t offset = 0;
  while (!IsValidUtf8(rest, &offset)) {
    sanitized.append(rest.data(), offset);
    sanitized.append(kBadByteMarker);
    rest.remove_prefix(offset + 1);
  }
  sanitized.append(rest.data(), rest.size());
  absl::StatusOr<json> parsed = ParseJson(sanitized);
  if (!parsed.ok()) return ParseJson(body);  // the original's error and position
  std::string path;
  if (FindMarker(*parsed, "", 0, &path)) {
    return FieldError(
        path, absl::StrFormat("%s must be valid UTF-8 (invalid byte at body offset %d)", path,
                              first_bad));
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("request body is not valid UTF-8 (invalid byte at offset %d)", first_bad));
}

// Known fields: absent and null both mean "unset", as in the OpenAI API.
const json* Find(const json& object, absl::string_view key) {
  const auto it = object.find(std::string(key));
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status TypeError(absl::string_view field, absl::string_view want, const json& got) {
  return FieldError(field, absl::StrCat(field, " must be ", want, ", got ", got.type_name()));
}

absl::Status GetBool(const json& object, absl::string_view key, bool* out) {
  const json* v = Find(object, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return TypeError(key, "a boolean", *v);
  *out = v->get<bool>();
  return absl::OkStatus();
}

absl::Status GetNumber(const json& object, absl::string_view key, std::optional<double>* out) {
  const json* v = Find(object, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return TypeError(key, "a number", *v);
  *out = v->get<double>();
  return absl::OkStatus();
}

// Integers within int64 (nlohmann keeps integers up to 2^64-1 as unsigned).
absl::Status GetInt(const json& object, absl::string_view key, std::optional<int64_t>* out) {
  const json* v = Find(object, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number_integer()) return TypeError(key, "an integer", *v);
  if (v->is_number_unsigned() &&
      v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return FieldError(key, absl::StrCat(key, " is out of range, got ", v->get<uint64_t>()));
  }
  *out = v->get<int64_t>();
  return absl::OkStatus();
}

absl::Status GetString(const json& object, absl::string_view key, std::optional<std::string>* out) {
  const json* v = Find(object, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_string()) return TypeError(key, "a string", *v);
  *out = v->get<std::string>();
  return absl::OkStatus();
}

absl::Status Unsupported(absl::string_view field, absl::string_view what = "") {
  return FieldError(field, absl::StrCat(field, what.empty() ? "" : " ", what,
                                        " is not supported by this server"));
}

absl::Status ParseTokenIds(const json& array, absl::string_view field, std::vector<uint32_t>* out) {
  if (array.empty()) return FieldError(field, absl::StrCat(field, " must not be empty"));
  out->reserve(array.size());
  for (size_t i = 0; i < array.size(); ++i) {
    const json& t = array[i];
    if (!t.is_number_integer() || (!t.is_number_unsigned() && t.get<int64_t>() < 0) ||
        t.get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
      const std::string name = absl::StrCat(field, "[", i, "]");
      return FieldError(name, absl::StrCat(name, " must be a token id in [0, 4294967295]"));
    }
    out->push_back(t.get<uint32_t>());
  }
  return absl::OkStatus();
}

bool AllIntegers(const json& array) {
  for (const json& e : array) {
    if (!e.is_number_integer()) return false;
  }
  return true;
}

absl::Status ParsePrompt(const json& body, CompletionRequest* request) {
  const json* prompt = Find(body, "prompt");
  if (prompt == nullptr) return FieldError("prompt", "prompt is required");
  constexpr absl::string_view kShape =
      "prompt must be a string, an array of token ids, or an array holding one of those";
  if (prompt->is_string()) {
    request->prompt_text = prompt->get<std::string>();
    return absl::OkStatus();
  }
  if (!prompt->is_array()) return TypeError("prompt", "a string or an array of token ids", *prompt);
  if (prompt->empty()) return FieldError("prompt", "prompt must not be empty");
  if (AllIntegers(*prompt)) return ParseTokenIds(*prompt, "prompt", &request->prompt_tokens);
  for (const json& e : *prompt) {
    if (!e.is_string() && !e.is_array()) return FieldError("prompt", kShape);
  }
  if (prompt->size() != 1) {
    return FieldError("prompt", absl::StrCat("prompt: one prompt per request is supported, got ",
                                             prompt->size()));
  }
  const json& only = (*prompt)[0];
  if (only.is_string()) {
    request->prompt_text = only.get<std::string>();
    return absl::OkStatus();
  }
  if (!AllIntegers(only)) return FieldError("prompt[0]", "prompt[0] must be an array of token ids");
  return ParseTokenIds(only, "prompt[0]", &request->prompt_tokens);
}

absl::StatusOr<ChatMessage> ParseMessage(const json& m, size_t index) {
  const std::string at = absl::StrCat("messages[", index, "]");
  if (!m.is_object()) return TypeError(at, "an object", m);
  ChatMessage message;
  const std::string role_field = at + ".role";
  const json* role = Find(m, "role");
  if (role == nullptr) return FieldError(role_field, role_field + " is required");
  if (!role->is_string()) return TypeError(role_field, "a string", *role);
  message.role = role->get<std::string>();
  if (message.role == "developer") message.role = "system";
  if (message.role == "tool" || message.role == "function") {
    return FieldError(role_field,
                      absl::StrCat(role_field, " '", message.role, "' is not supported"));
  }
  if (message.role != "system" && message.role != "user" && message.role != "assistant") {
    return FieldError(role_field, absl::StrCat(role_field,
                                               " must be one of system, developer, user, "
                                               "assistant, got '",
                                               message.role, "'"));
  }
  if (const json* calls = Find(m, "tool_calls"); calls != nullptr && !calls->empty()) {
    return Unsupported(at + ".tool_calls");
  }
  const std::string content_field = at + ".content";
  const json* content = Find(m, "content");
  if (content == nullptr) {
    if (message.role == "assistant") return message;  // content may be null for assistant turns
    return FieldError(content_field, content_field + " is required");
  }
  if (content->is_string()) {
    message.content = content->get<std::string>();
    return message;
  }
  if (!content->is_array()) {
    return FieldError(content_field, content_field + " must be a string or an array of text parts");
  }
  // vLLM joins the text parts of one message with "\n" for string-content templates.
  std::vector<std::string> parts;
  for (size_t j = 0; j < content->size(); ++j) {
    const json& part = (*content)[j];
    const std::string part_field = absl::StrCat(content_field, "[", j, "]");
    if (!part.is_object()) {
      return FieldError(content_field,
                        content_field + " must be a string or an array of text parts");
    }
    const json* type = Find(part, "type");
    if (type == nullptr || !type->is_string()) {
      return FieldError(part_field + ".type", part_field + ".type must be a string");
    }
    if (type->get_ref<const std::string&>() != "text") {
      return FieldError(part_field + ".type",
                        absl::StrCat(part_field, ": only text parts are supported, got type '",
                                     type->get_ref<const std::string&>(), "'"));
    }
    const json* text = Find(part, "text");
    if (text == nullptr || !text->is_string()) {
      return FieldError(part_field + ".text", part_field + ".text must be a string");
    }
    parts.push_back(text->get<std::string>());
  }
  message.content = absl::StrJoin(parts, "\n");
  return message;
}

absl::Status ParseStop(const json& body, SamplingParams* sampling) {
  const json* stop = Find(body, "stop");
  if (stop == nullptr) return absl::OkStatus();
  if (stop->is_string()) {
    if (stop->get_ref<const std::string&>().empty()) {
      return FieldError("stop", "stop must not be empty");
    }
    sampling->stop.push_back(stop->get<std::string>());
    return absl::OkStatus();
  }
  if (!stop->is_array()) return TypeError("stop", "a string or an array of strings", *stop);
  if (stop->size() > 4) {
    return FieldError("stop", absl::StrCat("stop must have at most 4 strings, got ", stop->size()));
  }
  for (size_t i = 0; i < stop->size(); ++i) {
    const std::string field = absl::StrCat("stop[", i, "]");
    const json& s = (*stop)[i];
    if (!s.is_string()) return TypeError(field, "a string", s);
    if (s.get_ref<const std::string&>().empty()) {
      return FieldError(field, field + " must not be empty");
    }
    sampling->stop.push_back(s.get<std::string>());
  }
  return absl::OkStatus();
}

absl::Status ParseMaxTokens(const json& body, Endpoint endpoint, SamplingParams* sampling) {
  absl::string_view field = "max_tokens";
  std::optional<int64_t> value;
  if (endpoint == Endpoint::kChatCompletions) {
    STRATA_RETURN_IF_ERROR(GetInt(body, "max_completion_tokens", &value));
    if (value.has_value()) field = "max_completion_tokens";
  }
  if (!value.has_value()) STRATA_RETURN_IF_ERROR(GetInt(body, "max_tokens", &value));
  sampling->max_tokens = endpoint == Endpoint::kCompletions ? 16 : 0;
  if (!value.has_value()) return absl::OkStatus();
  if (*value < 1) {
    return FieldError(field, absl::StrCat(field, " must be >= 1, got ", *value));
  }
  if (*value > kMaxTokensCap) {
    return FieldError(field, absl::StrCat(field, " must be <= ", kMaxTokensCap, ", got ", *value));
  }
  sampling->max_tokens = static_cast<uint32_t>(*value);
  return absl::OkStatus();
}

// `key`, when present, into *out; kInvalidArgument naming it unless it is in [lo, hi] (or
// (lo, hi] with `open_low`).
absl::Status GetFloatIn(const json& body, const char* key, double lo, double hi, bool open_low,
                        float* out) {
  std::optional<double> v;
  STRATA_RETURN_IF_ERROR(GetNumber(body, key, &v));
  if (!v.has_value()) return absl::OkStatus();
  if (!((open_low ? *v > lo : *v >= lo) && *v <= hi)) {
    return FieldError(
        key, absl::StrCat(key, " must be in ", open_low ? "(" : "[", lo, ", ", hi, "], got ", *v));
  }
  *out = static_cast<float>(*v);
  return absl::OkStatus();
}

absl::Status ParseSampling(const json& body, Endpoint endpoint, SamplingParams* sampling) {
  std::optional<double> number;
  STRATA_RETURN_IF_ERROR(GetNumber(body, "temperature", &number));
  if (number.has_value()) {
    if (!(*number >= 0 && *number <= 2)) {
      return FieldError("temperature",
                        absl::StrCat("temperature must be in [0, 2], got ", *number));
    }
    sampling->temperature = static_cast<float>(*number);
  }
  number.reset();
  STRATA_RETURN_IF_ERROR(GetNumber(body, "top_p", &number));
  if (number.has_value()) {
    if (!(*number > 0 && *number <= 1)) {
      return FieldError("top_p", absl::StrCat("top_p must be in (0, 1], got ", *number));
    }
    sampling->top_p = static_cast<float>(*number);
  }
  std::optional<int64_t> integer;
  STRATA_RETURN_IF_ERROR(GetInt(body, "top_k", &integer));
  if (integer.has_value()) {
    // vLLM clients send -1 for "off".
    if (*integer < -1 || *integer > std::numeric_limits<uint32_t>::max()) {
      return FieldError("top_k", absl::StrCat("top_k must be >= 0 (or -1: off), got ", *integer));
    }
    sampling->top_k = *integer < 0 ? 0 : static_cast<uint32_t>(*integer);
  }
  integer.reset();
  STRATA_RETURN_IF_ERROR(GetInt(body, "seed", &integer));
  if (integer.has_value()) sampling->seed = static_cast<uint64_t>(*integer);
  STRATA_RETURN_IF_ERROR(ParseMaxTokens(body, endpoint, sampling));
  STRATA_RETURN_IF_ERROR(ParseStop(body, sampling));
  STRATA_RETURN_IF_ERROR(GetBool(body, "ignore_eos", &sampling->ignore_eos));
  // OpenAI's penalties, then vLLM's extensions.
  STRATA_RETURN_IF_ERROR(
      GetFloatIn(body, "presence_penalty", -2, 2, false, &sampling->presence_penalty));
  STRATA_RETURN_IF_ERROR(
      GetFloatIn(body, "frequency_penalty", -2, 2, false, &sampling->frequency_penalty));
  STRATA_RETURN_IF_ERROR(
      GetFloatIn(body, "repetition_penalty", 0, 100, true, &sampling->repetition_penalty));
  STRATA_RETURN_IF_ERROR(GetFloatIn(body, "min_p", 0, 1, false, &sampling->min_p));
  if (const json* bias = Find(body, "logit_bias"); bias != nullptr) {
    if (!bias->is_object()) return TypeError("logit_bias", "an object", *bias);
    if (!bias->empty()) return Unsupported("logit_bias");
  }
  return absl::OkStatus();
}

// Fields that ask for something Strata does not do: refused, never silently ignored.
// Completions: "echo" and "logprobs": N (the N most likely tokens with each). Chat: "logprobs":
// true and "top_logprobs": N (which needs logprobs). N in [0, 20].
absl::Status ParseLogprobs(const json& body, Endpoint endpoint, CompletionRequest* request) {
  const uint32_t most = kMaxTopLogprobs;  // model/logprobs.h's limit
  std::optional<int64_t> n;
  if (endpoint == Endpoint::kCompletions) {
    STRATA_RETURN_IF_ERROR(GetBool(body, "echo", &request->echo));
    STRATA_RETURN_IF_ERROR(GetInt(body, "logprobs", &n));
    if (!n.has_value()) return absl::OkStatus();
    if (*n < 0 || *n > most) {
      return FieldError("logprobs", absl::StrCat("logprobs must be in [0, ", most, "], got ", *n));
    }
    request->logprobs = true;
    request->top_logprobs = static_cast<uint32_t>(*n);
    return absl::OkStatus();
  }
  STRATA_RETURN_IF_ERROR(GetBool(body, "logprobs", &request->logprobs));
  STRATA_RETURN_IF_ERROR(GetInt(body, "top_logprobs", &n));
  if (!n.has_value()) return absl::OkStatus();
  if (*n < 0 || *n > most) {
    return FieldError("top_logprobs",
                      absl::StrCat("top_logprobs must be in [0, ", most, "], got ", *n));
  }
  if (!request->logprobs && *n > 0) {
    return FieldError("top_logprobs", "top_logprobs needs logprobs set to true");
  }
  request->top_logprobs = static_cast<uint32_t>(*n);
  return absl::OkStatus();
}

// "n" choices (each sampled on its own, over one computation of the prompt); completions'
// "best_of" only as n (no choices generated to be thrown away).
absl::Status ParseChoices(const json& body, Endpoint endpoint, CompletionRequest* request) {
  std::optional<int64_t> n;
  STRATA_RETURN_IF_ERROR(GetInt(body, "n", &n));
  if (n.has_value()) {
    if (*n < 1 || *n > kMaxChoices) {
      return FieldError("n", absl::StrCat("n must be in [1, ", kMaxChoices, "], got ", *n));
    }
    request->n = static_cast<uint32_t>(*n);
  }
  if (endpoint != Endpoint::kCompletions) return absl::OkStatus();
  std::optional<int64_t> best_of;
  STRATA_RETURN_IF_ERROR(GetInt(body, "best_of", &best_of));
  if (best_of.has_value() && *best_of != request->n) {
    return FieldError("best_of",
                      absl::StrCat("best_of must equal n (", request->n,
                                   "): choices are not generated to be discarded, got ", *best_of));
  }
  return absl::OkStatus();
}

absl::Status ParseUnsupported(const json& body, Endpoint endpoint) {
  bool flag = false;
  if (endpoint == Endpoint::kCompletions) {
    std::optional<std::string> suffix;
    STRATA_RETURN_IF_ERROR(GetString(body, "suffix", &suffix));
    if (suffix.has_value() && !suffix->empty()) return Unsupported("suffix");
    return absl::OkStatus();
  }
  STRATA_RETURN_IF_ERROR(GetBool(body, "echo", &flag));
  if (flag) return Unsupported("echo");
  if (const json* tools = Find(body, "tools"); tools != nullptr) {
    if (!tools->is_array()) return TypeError("tools", "an array", *tools);
    if (!tools->empty()) return Unsupported("tools");
  }
  if (const json* choice = Find(body, "tool_choice"); choice != nullptr) {
    if (!choice->is_string() && !choice->is_object()) {
      return TypeError("tool_choice", "a string or an object", *choice);
    }
    if (!choice->is_string() || (*choice != "none" && *choice != "auto")) {
      return Unsupported("tool_choice", "other than \"none\"");
    }
  }
  for (const char* key : {"functions", "function_call"}) {
    if (Find(body, key) != nullptr) return Unsupported(key);
  }
  if (const json* format = Find(body, "response_format"); format != nullptr) {
    if (!format->is_object()) return TypeError("response_format", "an object", *format);
    const json* type = Find(*format, "type");
    if (type == nullptr || !type->is_string()) {
      return FieldError("response_format.type", "response_format.type must be a string");
    }
    if (*type != "text") return Unsupported("response_format.type", "other than \"text\"");
  }
  return absl::OkStatus();
}

ordered_json UsageJson(const Usage& usage) {
  ordered_json u;
  u["prompt_tokens"] = usage.prompt_tokens;
  u["completion_tokens"] = usage.completion_tokens;
  u["total_tokens"] = uint64_t{usage.prompt_tokens} + usage.completion_tokens;
  u["prompt_tokens_details"] = {{"cached_tokens", usage.cached_tokens}};
  return u;
}

ordered_json Envelope(const ResponseContext& ctx, absl::string_view object) {
  ordered_json j;
  j["id"] = ctx.id;
  j["object"] = std::string(object);
  j["created"] = ctx.created;
  j["model"] = ctx.model;
  j["system_fingerprint"] = std::string(kSystemFingerprint);
  return j;
}

// Backend text is promised to be UTF-8; replace rather than throw if a backend slips.
std::string Dump(const ordered_json& j) {
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

std::string Event(const ordered_json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

ordered_json Chunk(const ResponseContext& ctx, ordered_json choice) {
  ordered_json j = Envelope(ctx, ctx.chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = ordered_json::array({std::move(choice)});
  if (ctx.include_usage) j["usage"] = nullptr;
  return j;
}

// A token as JSON text (U+FFFD for bytes that form no character) and its exact bytes.
std::string TokenText(const std::string& bytes) {
  std::string out;
  AppendUtf8Replacing(bytes, /*final=*/true, &out);
  return out;
}
ordered_json TokenBytes(const std::string& bytes) {
  ordered_json b = ordered_json::array();
  for (unsigned char c : bytes) b.push_back(static_cast<int>(c));
  return b;
}

// OpenAI's logprobs object of a choice: chat {"content": [{token, logprob, bytes,
// top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs, text_offset}, offsets
// counted from `text_offset` in bytes of the tokens' text. Null without logprobs.
ordered_json LogprobsJson(const ResponseContext& ctx, absl::Span<const TokenLogprobs> tokens,
                          size_t text_offset) {
  if (!ctx.logprobs) return nullptr;
  if (ctx.chat) {
    ordered_json content = ordered_json::array();
    for (const TokenLogprobs& t : tokens) {
      ordered_json e;
      e["token"] = TokenText(t.chosen.token);
      e["logprob"] = t.chosen.logprob;
      e["bytes"] = TokenBytes(t.chosen.token);
      ordered_json top = ordered_json::array();
      for (const LogprobEntry& a : t.top) {
        top.push_back({{"token", TokenText(a.token)},
                       {"logprob", a.logprob},
                       {"bytes", TokenBytes(a.token)}});
      }
      e["top_logprobs"] = std::move(top);
      content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}};
  }
  ordered_json toks = ordered_json::array(), lps = ordered_json::array(),
               tops = ordered_json::array(), offsets = ordered_json::array();
  for (const TokenLogprobs& t : tokens) {
    toks.push_back(TokenText(t.chosen.token));
    offsets.push_back(text_offset);
    text_offset += t.chosen.token.size();
    if (!t.known) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    lps.push_back(t.chosen.logprob);
    ordered_json top = ordered_json::object();
    for (const LogprobEntry& a : t.top) top[TokenText(a.token)] = a.logprob;
    tops.push_back(std::move(top));
  }
  return {{"tokens", std::move(toks)},
          {"token_logprobs", std::move(lps)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

ordered_json StreamChoice(const ResponseContext& ctx, ordered_json delta_or_text,
                          std::optional<FinishReason> reason, ordered_json logprobs = nullptr,
                          uint32_t index = 0) {
  ordered_json choice;
  choice["index"] = index;
  choice[ctx.chat ? "delta" : "text"] = std::move(delta_or_text);
  choice["logprobs"] = std::move(logprobs);
  choice["finish_reason"] = reason.has_value()
                                ? ordered_json(std::string(FinishReasonName(*reason)))
                                : ordered_json(nullptr);
  return choice;
}

}  // namespace

absl::Status FieldError(absl::string_view param, absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kParamPayload, absl::Cord(param));
  return status;
}

absl::Status WithRetryAfter(absl::Status status, int seconds) {
  status.SetPayload(kRetryAfterPayload, absl::Cord(absl::StrCat(std::max(1, seconds))));
  return status;
}

int RetryAfterSeconds(const absl::Status& status) {
  absl::optional<absl::Cord> p = status.GetPayload(kRetryAfterPayload);
  int seconds = 1;
  if (p.has_value() && absl::SimpleAtoi(std::string(*p), &seconds) && seconds >= 1) return seconds;
  return 1;
}

std::optional<std::string> ErrorParam(const absl::Status& status) {
  absl::optional<absl::Cord> param = status.GetPayload(kParamPayload);
  if (!param.has_value()) return std::nullopt;
  return std::string(*param);
}

absl::StatusOr<CompletionRequest> ParseCompletionRequest(absl::string_view body, Endpoint endpoint,
                                                         const ChatRenderer& render_chat) {
  STRATA_ASSIGN_OR_RETURN(const json parsed, ParseBody(body));
  if (!parsed.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request body must be a JSON object, got ", parsed.type_name()));
  }
  CompletionRequest request;
  request.chat = endpoint == Endpoint::kChatCompletions;
  std::optional<std::string> text;
  STRATA_RETURN_IF_ERROR(GetString(parsed, "model", &text));
  if (!text.has_value() || text->empty()) return FieldError("model", "model is required");
  request.model = std::move(*text);

  std::vector<ChatMessage> messages;
  if (request.chat) {
    const json* list = Find(parsed, "messages");
    if (list == nullptr) return FieldError("messages", "messages is required");
    if (!list->is_array()) return TypeError("messages", "an array", *list);
    if (list->empty()) return FieldError("messages", "messages must not be empty");
    messages.reserve(list->size());
    for (size_t i = 0; i < list->size(); ++i) {
      STRATA_ASSIGN_OR_RETURN(ChatMessage m, ParseMessage((*list)[i], i));
      messages.push_back(std::move(m));
    }
  } else {
    STRATA_RETURN_IF_ERROR(ParsePrompt(parsed, &request));
  }

  STRATA_RETURN_IF_ERROR(ParseSampling(parsed, endpoint, &request.sampling));
  STRATA_RETURN_IF_ERROR(ParseUnsupported(parsed, endpoint));
  STRATA_RETURN_IF_ERROR(ParseLogprobs(parsed, endpoint, &request));
  STRATA_RETURN_IF_ERROR(ParseChoices(parsed, endpoint, &request));
  STRATA_RETURN_IF_ERROR(GetBool(parsed, "stream", &request.stream));
  if (const json* options = Find(parsed, "stream_options"); options != nullptr) {
    if (!options->is_object()) return TypeError("stream_options", "an object", *options);
    if (!request.stream) {
      return FieldError("stream_options", "stream_options is only allowed when stream is true");
    }
    const json* usage = Find(*options, "include_usage");
    if (usage != nullptr) {
      if (!usage->is_boolean()) {
        return TypeError("stream_options.include_usage", "a boolean", *usage);
      }
      request.include_usage = usage->get<bool>();
    }
  }
  text.reset();
  STRATA_RETURN_IF_ERROR(GetString(parsed, "cache_salt", &text));
  if (text.has_value()) request.cache_salt = std::move(*text);
  text.reset();
  STRATA_RETURN_IF_ERROR(GetString(parsed, "user", &text));  // accepted, not used

  if (request.chat) {
    if (!render_chat) return absl::InternalError("ParseCompletionRequest: no chat renderer");
    STRATA_ASSIGN_OR_RETURN(request.prompt_text, render_chat(request.model, messages));
  }
  return request;
}

ApiError ToApiError(const absl::Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  e.param = ErrorParam(status);
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      e.http_status = 400;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "not_found_error";
      break;
    case absl::StatusCode::kOutOfRange:
      e.http_status = 413;
      e.type = "invalid_request_error";
      e.code = "request_too_large";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      e.retry_after_seconds = RetryAfterSeconds(status);
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "service_unavailable_error";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout_error";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      e.code = std::string(absl::StatusCodeToString(status.code()));
      break;
  }
  return e;
}

std::string RenderErrorJson(const ApiError& error) {
  ordered_json e;
  e["message"] = error.message;
  e["type"] = error.type;
  e["param"] = error.param.has_value() ? ordered_json(*error.param) : ordered_json(nullptr);
  e["code"] = error.code.has_value() ? ordered_json(*error.code) : ordered_json(nullptr);
  ordered_json j;
  j["error"] = std::move(e);
  return Dump(j);
}

absl::string_view FinishReasonName(FinishReason reason) {
  return reason == FinishReason::kLength ? "length" : "stop";
}

std::string RenderCompletionResponse(const ResponseContext& ctx,
                                     absl::Span<const ChoiceResult> choices, const Usage& usage) {
  ordered_json j = Envelope(ctx, ctx.chat ? "chat.completion" : "text_completion");
  ordered_json list = ordered_json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    ordered_json choice;
    choice["index"] = i;
    if (ctx.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    } else {
      choice["text"] = c.text;
    }
    choice["logprobs"] = LogprobsJson(ctx, c.logprobs, 0);
    choice["finish_reason"] = std::string(FinishReasonName(c.reason));
    list.push_back(std::move(choice));
  }
  j["choices"] = std::move(list);
  j["usage"] = UsageJson(usage);
  return Dump(j);
}

std::string RenderCompletionResponse(const ResponseContext& ctx, absl::string_view text,
                                     FinishReason reason, const Usage& usage,
                                     absl::Span<const TokenLogprobs> logprobs) {
  const ChoiceResult one{std::string(text), reason,
                         std::vector<TokenLogprobs>(logprobs.begin(), logprobs.end())};
  return RenderCompletionResponse(ctx, absl::MakeConstSpan(&one, 1), usage);
}

std::string RenderStreamRoleEvent(const ResponseContext& ctx) {
  return Event(
      Chunk(ctx, StreamChoice(ctx, {{"role", "assistant"}, {"content", ""}}, std::nullopt)));
}

std::string RenderStreamTextEvent(const ResponseContext& ctx, absl::string_view text,
                                  absl::Span<const TokenLogprobs> logprobs, size_t text_offset,
                                  uint32_t index) {
  ordered_json payload =
      ctx.chat ? ordered_json{{"content", std::string(text)}} : ordered_json(std::string(text));
  return Event(Chunk(ctx, StreamChoice(ctx, std::move(payload), std::nullopt,
                                       LogprobsJson(ctx, logprobs, text_offset), index)));
}

std::string RenderStreamFinishEvent(const ResponseContext& ctx, FinishReason reason,
                                    uint32_t index) {
  ordered_json payload = ctx.chat ? ordered_json::object() : ordered_json("");
  return Event(Chunk(ctx, StreamChoice(ctx, std::move(payload), reason, nullptr, index)));
}

std::string RenderStreamUsageEvent(const ResponseContext& ctx, const Usage& usage) {
  ordered_json j = Envelope(ctx, ctx.chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = ordered_json::array();
  j["usage"] = UsageJson(usage);
  return Event(j);
}

std::string RenderStreamErrorEvent(const ApiError& error) {
  return absl::StrCat("data: ", RenderErrorJson(error), "\n\n");
}

std::string RenderModelList(const std::vector<ModelCard>& models) {
  ordered_json data = ordered_json::array();
  for (const ModelCard& m : models) {
    ordered_json card;
    card["id"] = m.id;
    card["object"] = "model";
    card["created"] = m.created;
    card["owned_by"] = m.owned_by;
    card["max_model_len"] = m.max_model_len;
    data.push_back(std::move(card));
  }
  ordered_json j;
  j["object"] = "list";
  j["data"] = std::move(data);
  return Dump(j);
}

}  // namespace strata::router
