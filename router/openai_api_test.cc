#include "router/openai_api.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace strata::router {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

// Renders messages as "role:content|..." so tests can see what the parser handed over.
const ChatRenderer kEchoRenderer =
    [](const std::string& model,
       absl::Span<const ChatMessage> messages) -> absl::StatusOr<std::string> {
  std::string out = model + ">";
  for (const ChatMessage& m : messages) out += m.role + ":" + m.content + "|";
  return out;
};

absl::StatusOr<CompletionRequest> Completion(const std::string& body) {
  return ParseCompletionRequest(body, Endpoint::kCompletions, nullptr);
}
absl::StatusOr<CompletionRequest> Chat(const std::string& body) {
  return ParseCompletionRequest(body, Endpoint::kChatCompletions, kEchoRenderer);
}

// Expects INVALID_ARGUMENT whose message contains `message` and whose param is `param`.
void ExpectFieldError(const absl::StatusOr<CompletionRequest>& r, const std::string& param,
                      const std::string& message) {
  ASSERT_FALSE(r.ok()) << "accepted; wanted an error about " << param;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(message));
  if (param.empty()) {
    EXPECT_FALSE(ErrorParam(r.status()).has_value());
  } else {
    EXPECT_EQ(ErrorParam(r.status()).value_or("(none)"), param) << r.status();
  }
}

TEST(OpenAiApiTest, ParsesACompletionRequest) {
  absl::StatusOr<CompletionRequest> r =
      Completion(R"({"model":"m","prompt":"Hello","max_tokens":32,"temperature":0.5,"top_p":0.9,)"
                 R"("top_k":40,"seed":-1,"stop":["\n","END"],"stream":true,"ignore_eos":true,)"
                 R"("stream_options":{"include_usage":true},"cache_salt":"tenant-a","user":"u",)"
                 R"("n":1,"presence_penalty":0,"logprobs":null,"some_future_field":{"x":[1,2]}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model, "m");
  EXPECT_FALSE(r->chat);
  EXPECT_EQ(r->prompt_text, "Hello");
  EXPECT_TRUE(r->prompt_tokens.empty());
  EXPECT_EQ(r->sampling.max_tokens, 32u);
  EXPECT_FLOAT_EQ(r->sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r->sampling.top_p, 0.9f);
  EXPECT_EQ(r->sampling.top_k, 40u);
  EXPECT_EQ(r->sampling.seed, ~uint64_t{0});
  EXPECT_EQ(r->sampling.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_TRUE(r->sampling.ignore_eos);
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_EQ(r->cache_salt, "tenant-a");
}

TEST(OpenAiApiTest, ParsesPenaltiesAndMinP) {
  absl::StatusOr<CompletionRequest> r =
      Completion(R"({"model":"m","prompt":"Hello","presence_penalty":0.5,)"
                 R"("frequency_penalty":-0.25,"repetition_penalty":1.2,"min_p":0.05})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FLOAT_EQ(r->sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r->sampling.frequency_penalty, -0.25f);
  EXPECT_FLOAT_EQ(r->sampling.repetition_penalty, 1.2f);
  EXPECT_FLOAT_EQ(r->sampling.min_p, 0.05f);
  r = Completion(R"({"model":"m","prompt":"Hello"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sampling.presence_penalty, 0.0f);
  EXPECT_EQ(r->sampling.repetition_penalty, 1.0f);
  EXPECT_EQ(r->sampling.min_p, 0.0f);
}

TEST(OpenAiApiTest, Defaults) {
  absl::StatusOr<CompletionRequest> r = Completion(R"({"model":"m","prompt":"x"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sampling.max_tokens, 16u);
  EXPECT_EQ(r->sampling.temperature, 1.0f);
  EXPECT_EQ(r->sampling.top_p, 1.0f);
  EXPECT_EQ(r->sampling.top_k, 0u);
  EXPECT_FALSE(r->sampling.seed.has_value());
  EXPECT_FALSE(r->sampling.ignore_eos);
  EXPECT_FALSE(r->stream);
  absl::StatusOr<CompletionRequest> c =
      Chat(R"({"model":"m","messages":[{"role":"user","content":"x"}]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sampling.max_tokens, 0u);
  EXPECT_TRUE(c->chat);
}

TEST(OpenAiApiTest, PromptShapes) {
  absl::StatusOr<CompletionRequest> ids = Completion(R"({"model":"m","prompt":[1,2,4294967295]})");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->prompt_tokens, (std::vector<uint32_t>{1, 2, 4294967295u}));
  EXPECT_TRUE(ids->prompt_text.empty());
  absl::StatusOr<CompletionRequest> one = Completion(R"({"model":"m","prompt":["only"]})");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->prompt_text, "only");
  absl::StatusOr<CompletionRequest> nested = Completion(R"({"model":"m","prompt":[[7,8]]})");
  ASSERT_TRUE(nested.ok());
  EXPECT_EQ(nested->prompt_tokens, (std::vector<uint32_t>{7, 8}));
  ExpectFieldError(Completion(R"({"model":"m","prompt":["a","b"]})"), "prompt",
                   "one prompt per request");
  ExpectFieldError(Completion(R"({"model":"m","prompt":[[1],[2]]})"), "prompt",
                   "one prompt per request");
  ExpectFieldError(Completion(R"({"model":"m","prompt":[]})"), "prompt", "must not be empty");
  ExpectFieldError(Completion(R"({"model":"m","prompt":[1,-2]})"), "prompt[1]", "token id");
  ExpectFieldError(Completion(R"({"model":"m","prompt":[4294967296]})"), "prompt[0]", "token id");
  ExpectFieldError(Completion(R"({"model":"m","prompt":[1,"a"]})"), "prompt", "prompt must be");
  ExpectFieldError(Completion(R"({"model":"m","prompt":7})"), "prompt", "prompt must be");
  ExpectFieldError(Completion(R"({"model":"m","prompt":[[]]})"), "prompt[0]", "must not be empty");
}

TEST(OpenAiApiTest, RefusesMalformedBodies) {
  ExpectFieldError(Completion(R"({"model":"m","prompt":)"), "", "not valid JSON (at byte");
  ExpectFieldError(Completion("[1,2]"), "", "must be a JSON object, got array");
  ExpectFieldError(Completion(""), "", "not valid JSON");
  ExpectFieldError(Completion(R"({"prompt":"x"})"), "model", "model is required");
  ExpectFieldError(Completion(R"({"model":5,"prompt":"x"})"), "model", "model must be a string");
  ExpectFieldError(Chat(R"({"model":"m"})"), "messages", "messages is required");
  ExpectFieldError(Chat(R"({"model":"m","messages":[]})"), "messages", "must not be empty");
  ExpectFieldError(Chat(R"({"model":"m","messages":{}})"), "messages", "must be an array");
}

TEST(OpenAiApiTest, RefusesOutOfRangeAndMistypedFields) {
  const std::string p = R"({"model":"m","prompt":"x",)";
  ExpectFieldError(Completion(p + R"("temperature":"hot"})"), "temperature",
                   "temperature must be a number, got string");
  ExpectFieldError(Completion(p + R"("temperature":2.5})"), "temperature", "[0, 2]");
  ExpectFieldError(Completion(p + R"("temperature":-0.1})"), "temperature", "[0, 2]");
  ExpectFieldError(Completion(p + R"("top_p":0})"), "top_p", "(0, 1]");
  ExpectFieldError(Completion(p + R"("top_p":1.01})"), "top_p", "(0, 1]");
  ExpectFieldError(Completion(p + R"("top_k":-2})"), "top_k", "top_k must be >= 0");
  ExpectFieldError(Completion(p + R"("top_k":1.5})"), "top_k", "must be an integer");
  ExpectFieldError(Completion(p + R"("ignore_eos":1})"), "ignore_eos",
                   "ignore_eos must be a boolean, got number");
  ExpectFieldError(Completion(p + R"("max_tokens":0})"), "max_tokens",
                   "max_tokens must be >= 1, got 0");
  ExpectFieldError(Completion(p + R"("max_tokens":2000000})"), "max_tokens", "must be <=");
  ExpectFieldError(Completion(p + R"("max_tokens":"8"})"), "max_tokens", "must be an integer");
  ExpectFieldError(Completion(p + R"("n":0})"), "n", "n must be in [1, 16]");
  ExpectFieldError(Completion(p + R"("n":17})"), "n", "n must be in [1, 16]");
  ExpectFieldError(Completion(p + R"("n":2,"best_of":3})"), "best_of", "must equal n (2)");
  ExpectFieldError(Completion(p + R"("stop":["a","b","c","d","e"]})"), "stop", "at most 4");
  ExpectFieldError(Completion(p + R"("stop":["a",1]})"), "stop[1]", "stop[1] must be a string");
  ExpectFieldError(Completion(p + R"("stop":""})"), "stop", "must not be empty");
  ExpectFieldError(Completion(p + R"("stream":"yes"})"), "stream", "must be a boolean");
  ExpectFieldError(Completion(p + R"("stream_options":{"include_usage":true}})"), "stream_options",
                   "only allowed when stream is true");
  ExpectFieldError(Completion(p + R"("stream":true,"stream_options":{"include_usage":1}})"),
                   "stream_options.include_usage", "must be a boolean");
  ExpectFieldError(Completion(p + R"("seed":1.5})"), "seed", "must be an integer");
  ExpectFieldError(Completion(p + R"("seed":18446744073709551615})"), "seed", "out of range");
  ExpectFieldError(Completion(p + R"("cache_salt":7})"), "cache_salt", "must be a string");
  ExpectFieldError(Completion(p + R"("user":[]})"), "user", "must be a string");
  ExpectFieldError(Completion(p + R"("logprobs":21})"), "logprobs", "must be in [0, 20]");
  ExpectFieldError(Completion(p + R"("logprobs":-1})"), "logprobs", "must be in [0, 20]");
  ExpectFieldError(Completion(p + R"("echo":1})"), "echo", "must be a boolean");
  ExpectFieldError(Completion(p + R"("suffix":"end"})"), "suffix", "not supported");
  ExpectFieldError(Completion(p + R"("presence_penalty":2.5})"), "presence_penalty",
                   "must be in [-2, 2]");
  ExpectFieldError(Completion(p + R"("frequency_penalty":-3})"), "frequency_penalty",
                   "must be in [-2, 2]");
  ExpectFieldError(Completion(p + R"("repetition_penalty":0})"), "repetition_penalty",
                   "must be in (0, 100]");
  ExpectFieldError(Completion(p + R"("min_p":1.5})"), "min_p", "must be in [0, 1]");
  ExpectFieldError(Completion(p + R"("logit_bias":{"5":1}})"), "logit_bias", "not supported");
  // vLLM's "off" spelling of top_k, and nulls, are accepted.
  absl::StatusOr<CompletionRequest> r =
      Completion(p + R"("top_k":-1,"temperature":null,"stop":null,"echo":false})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sampling.top_k, 0u);
}

TEST(OpenAiApiTest, ChatMessages) {
  absl::StatusOr<CompletionRequest> r =
      Chat(R"({"model":"m","messages":[{"role":"developer","content":"be nice"},)"
           R"({"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},)"
           R"({"role":"assistant","content":null},{"role":"user","content":"q","name":"bob"}],)"
           R"("max_completion_tokens":9,"max_tokens":3,"logprobs":false,"tool_choice":"none"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_text, "m>system:be nice|user:a\nb|assistant:|user:q|");
  EXPECT_EQ(r->sampling.max_tokens, 9u);  // max_completion_tokens wins
  const std::string m = R"({"model":"m","messages":)";
  ExpectFieldError(Chat(m + R"([{"role":"user","content":5}]})"), "messages[0].content",
                   "messages[0].content must be a string or an array of text parts");
  ExpectFieldError(Chat(m + R"([{"role":"user","content":"a"},{"role":"user"},{}]})"),
                   "messages[1].content", "messages[1].content is required");
  ExpectFieldError(Chat(m + R"([{"role":"user","content":"a"},"hi"]})"), "messages[1]",
                   "messages[1] must be an object");
  ExpectFieldError(Chat(m + R"([{"role":"tool","content":"a"}]})"), "messages[0].role",
                   "not supported");
  ExpectFieldError(Chat(m + R"([{"role":"wizard","content":"a"}]})"), "messages[0].role",
                   "must be one of");
  ExpectFieldError(
      Chat(m + R"([{"role":"user","content":[{"type":"image_url","image_url":{}}]}]})"),
      "messages[0].content[0].type", "only text parts");
  ExpectFieldError(Chat(m + R"([{"role":"user","content":"a"}],"max_completion_tokens":0})"),
                   "max_completion_tokens", "max_completion_tokens must be >= 1, got 0");
  ExpectFieldError(Chat(m + R"([{"role":"user","content":"a"}],"top_logprobs":3})"), "top_logprobs",
                   "needs logprobs");
  ExpectFieldError(
      Chat(m + R"([{"role":"user","content":"a"}],"logprobs":true,"top_logprobs":30})"),
      "top_logprobs", "must be in [0, 20]");
  ExpectFieldError(Chat(m + R"([{"role":"user","content":"a"}],"echo":true})"), "echo",
                   "not supported");
  ExpectFieldError(Chat(m + R"([{"role":"user","content":"a"}],"tools":[{"type":"function"}]})"),
                   "tools", "not supported");
  ExpectFieldError(
      Chat(m + R"([{"role":"user","content":"a"}],"response_format":{"type":"json_object"}})"),
      "response_format.type", "not supported");
}

TEST(OpenAiApiTest, ChatRendererErrorsPassThrough) {
  const ChatRenderer failing = [](const std::string&,
                                  absl::Span<const ChatMessage>) -> absl::StatusOr<std::string> {
    return absl::NotFoundError("no such model");
  };
  absl::StatusOr<CompletionRequest> r =
      ParseCompletionRequest(R"({"model":"m","messages":[{"role":"user","content":"a"}]})",
                             Endpoint::kChatCompletions, failing);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

TEST(OpenAiApiTest, InvalidUtf8NamesTheField) {
  ExpectFieldError(Completion("{\"model\":\"m\",\"prompt\":\"ok\xc3\x28\"}"), "prompt",
                   "prompt must be valid UTF-8");
  ExpectFieldError(
      Chat("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xed\xa0\x80\"}]}"),
      "messages[0].content", "must be valid UTF-8");
  ExpectFieldError(Completion("{\"model\":\"m\",\"prompt\":\"x\",\"stop\":[\"\xff\"]}"), "stop[0]",
                   "valid UTF-8");
  // Outside any string it is a JSON syntax error.
  ExpectFieldError(Completion("{\"model\":\"m\",\"prompt\":\"x\"\xff}"), "", "not valid JSON");
}

TEST(OpenAiApiTest, ErrorMapping) {
  EXPECT_EQ(ToApiError(absl::InvalidArgumentError("x")).http_status, 400);
  EXPECT_EQ(ToApiError(absl::NotFoundError("x")).http_status, 404);
  EXPECT_EQ(ToApiError(absl::OutOfRangeError("x")).http_status, 413);
  EXPECT_EQ(ToApiError(absl::ResourceExhaustedError("x")).http_status, 429);
  EXPECT_EQ(ToApiError(absl::UnavailableError("x")).http_status, 503);
  EXPECT_EQ(ToApiError(absl::DeadlineExceededError("x")).http_status, 504);
  EXPECT_EQ(ToApiError(absl::InternalError("x")).http_status, 500);
  const json e = json::parse(RenderErrorJson(ToApiError(FieldError("top_p", "top_p bad"))));
  EXPECT_EQ(e["error"]["message"], "top_p bad");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "top_p");
  EXPECT_TRUE(e["error"]["code"].is_null());
  const std::string event = RenderStreamErrorEvent(ToApiError(absl::UnavailableError("gone")));
  EXPECT_EQ(event.substr(0, 6), "data: ");
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n");
  EXPECT_EQ(json::parse(event.substr(6))["error"]["message"], "gone");
}

TEST(OpenAiApiTest, ParsesChoices) {
  absl::StatusOr<CompletionRequest> r =
      Completion(R"({"model":"m","prompt":"x","n":3,"best_of":3})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->n, 3u);
  r = Chat(R"({"model":"m","messages":[{"role":"user","content":"a"}],"n":2})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->n, 2u);
  r = Completion(R"({"model":"m","prompt":"x"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->n, 1u);
}

TEST(OpenAiApiTest, RendersSeveralChoices) {
  ResponseContext ctx{"cmpl-1", "m", 1, false, false, false};
  const std::vector<ChoiceResult> choices = {{"a", FinishReason::kStop, {}},
                                             {"b", FinishReason::kLength, {}}};
  const json j = json::parse(RenderCompletionResponse(ctx, choices, Usage{3, 5, 0}));
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][1]["text"], "b");
  EXPECT_EQ(j["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["total_tokens"], 8);
  const json e = json::parse(RenderStreamTextEvent(ctx, "b", {}, 0, 1).substr(6));
  EXPECT_EQ(e["choices"][0]["index"], 1);
  const json f = json::parse(RenderStreamFinishEvent(ctx, FinishReason::kStop, 1).substr(6));
  EXPECT_EQ(f["choices"][0]["index"], 1);
}

TEST(OpenAiApiTest, ParsesLogprobsAndEcho) {
  absl::StatusOr<CompletionRequest> r =
      Completion(R"({"model":"m","prompt":"x","logprobs":5,"echo":true})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 5u);
  EXPECT_TRUE(r->echo);
  r = Completion(R"({"model":"m","prompt":"x","logprobs":0})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 0u);
  r = Completion(R"({"model":"m","prompt":"x"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->logprobs);
  EXPECT_FALSE(r->echo);
  r = Chat(R"({"model":"m","messages":[{"role":"user","content":"a"}],"logprobs":true,)"
           R"("top_logprobs":2})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 2u);
}

TEST(OpenAiApiTest, RendersLogprobsInOpenAIsShapes) {
  const std::vector<TokenLogprobs> lps = {
      {.chosen = {"He", 0}, .top = {}, .known = false},
      {.chosen = {"llo", -0.5f}, .top = {{"llo", -0.5f}, {"y", -1.25f}}},
      {.chosen = {"\xE2", -2.0f}, .top = {{"\xE2", -2.0f}}}};  // part of a character
  ResponseContext ctx{"cmpl-1", "m", 1, false, false, true};
  json j = json::parse(RenderCompletionResponse(ctx, "Hello", FinishReason::kStop, {}, lps));
  const json& c = j["choices"][0]["logprobs"];
  EXPECT_EQ(c["tokens"], json::parse(R"(["He","llo","\ufffd"])"));
  EXPECT_TRUE(c["token_logprobs"][0].is_null());
  EXPECT_EQ(c["token_logprobs"][1], -0.5);
  EXPECT_TRUE(c["top_logprobs"][0].is_null());
  EXPECT_EQ(c["top_logprobs"][1], json::parse(R"({"llo":-0.5,"y":-1.25})"));
  EXPECT_EQ(c["text_offset"], json::parse("[0,2,5]"));
  // Streaming: one token's, its offset carried on.
  j = json::parse(RenderStreamTextEvent(ctx, "llo", absl::MakeConstSpan(&lps[1], 1), 2).substr(6));
  EXPECT_EQ(j["choices"][0]["logprobs"]["text_offset"], json::parse("[2]"));
  // Chat: content entries with bytes.
  ctx.chat = true;
  j = json::parse(RenderCompletionResponse(ctx, "llo", FinishReason::kStop, {},
                                           absl::MakeConstSpan(lps).subspan(1)));
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "llo");
  EXPECT_EQ(content[0]["logprob"], -0.5);
  EXPECT_EQ(content[0]["bytes"], json::parse("[108,108,111]"));
  EXPECT_EQ(content[0]["top_logprobs"][1],
            json::parse(R"({"token":"y","logprob":-1.25,"bytes":[121]})"));
  EXPECT_EQ(content[1]["bytes"], json::parse("[226]"));
  // Without logprobs asked: null, as before.
  ctx.logprobs = false;
  j = json::parse(RenderCompletionResponse(ctx, "x", FinishReason::kStop, {}, lps));
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
}

TEST(OpenAiApiTest, RendersResponses) {
  ResponseContext ctx{"cmpl-1", "m", 1700000000, false, false};
  const json text =
      json::parse(RenderCompletionResponse(ctx, "hi", FinishReason::kLength, Usage{3, 4, 2}));
  EXPECT_EQ(text["id"], "cmpl-1");
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["created"], 1700000000);
  EXPECT_EQ(text["system_fingerprint"], "fp_strata");
  EXPECT_EQ(text["choices"][0]["text"], "hi");
  EXPECT_EQ(text["choices"][0]["index"], 0);
  EXPECT_TRUE(text["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(text["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(text["usage"], json::parse(R"({"prompt_tokens":3,"completion_tokens":4,)"
                                       R"("total_tokens":7,"prompt_tokens_details":)"
                                       R"({"cached_tokens":2}})"));
  ctx.chat = true;
  const json chat = json::parse(RenderCompletionResponse(ctx, "yo", FinishReason::kStop, {}));
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"], json::parse(R"({"role":"assistant","content":"yo"})"));
  ctx.include_usage = true;
  const std::string role = RenderStreamRoleEvent(ctx);
  const json role_json = json::parse(role.substr(6));
  EXPECT_EQ(role_json["object"], "chat.completion.chunk");
  EXPECT_EQ(role_json["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(role_json["usage"].is_null());
  EXPECT_TRUE(role_json.contains("usage"));
  const json finish = json::parse(RenderStreamFinishEvent(ctx, FinishReason::kStop).substr(6));
  EXPECT_TRUE(finish["choices"][0]["delta"].empty());
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "stop");
  const json usage = json::parse(RenderStreamUsageEvent(ctx, Usage{1, 2, 0}).substr(6));
  EXPECT_TRUE(usage["choices"].is_array() && usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 3);
  const json models = json::parse(RenderModelList({ModelCard{"a", 5, "strata", 4096}}));
  EXPECT_EQ(models, json::parse(R"({"object":"list","data":[{"id":"a","object":"model",)"
                                R"("created":5,"owned_by":"strata","max_model_len":4096}]})"));
}

}  // namespace
}  // namespace strata::router
