#include "router/chat_template.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::router {
namespace {

// Template texts as they read after JSON-decoding tokenizer_config.json ("\n" inside Jinja
// string literals is the two characters backslash, n). Written from the public checkpoints.

// meta-llama/Meta-Llama-3-8B-Instruct
constexpr char kLlama3[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
    "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

// meta-llama/Llama-3.1-8B-Instruct (abridged: the tool-calling branches are left out; the
// parts that render messages without tools are verbatim).
constexpr char kLlama31[] =
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n"
    "{%- endif %}\n{%- if not tools_in_user_message is defined %}\n"
    "    {%- set tools_in_user_message = true %}\n{%- endif %}\n"
    "{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n"
    "{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n\n{#- System message + builtin tools #}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{%- if builtin_tools is defined or tools is not none %}\n"
    "    {{- \"Environment: ipython\\n\" }}\n{%- endif %}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n\n{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in "
    "message) %}\n        {{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n";

// Qwen/Qwen2-7B-Instruct
constexpr char kQwen2[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif "
    "%}{{'<|im_start|>' "
    "+ message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// teknium/OpenHermes-2.5-Mistral-7B (plain ChatML, no default system turn)
constexpr char kChatMl[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{% endif %}";

// mistralai/Mistral-7B-Instruct-v0.3 (abridged: tool branches left out).
constexpr char kMistralV03[] =
    "{%- if messages[0][\"role\"] == \"system\" %}\n"
    "    {%- set system_message = messages[0][\"content\"] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n"
    "    {%- set loop_messages = messages %}\n{%- endif %}\n"
    "{{- bos_token }}\n{%- for message in loop_messages %}\n"
    "    {%- if message[\"role\"] == \"user\" %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + "
    "\"[/INST]\" }}\n        {%- else %}\n"
    "            {{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}\n        {%- endif %}\n"
    "    {%- elif message[\"role\"] == \"assistant\" %}\n"
    "        {{- \" \" + message[\"content\"]|trim + eos_token}}\n    {%- else %}\n"
    "        {{- raise_exception(\"Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!\") }}\n    {%- endif %}\n{%- endfor %}\n";

// mistralai/Mistral-7B-Instruct-v0.1: " [/INST]", which Strata does not render.
constexpr char kMistralV01[] =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ "
    "'[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ "
    "message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}";

const std::vector<ChatMessage> kConversation = {
    {"system", "  Be brief. "},
    {"user", "Hi there\n"},
    {"assistant", " Hello! "},
    {"user", "What is 2+2?"},
};

std::string Render(const char* template_text, const std::vector<ChatMessage>& messages) {
  absl::StatusOr<ChatTemplate> t = AnalyzeChatTemplate(template_text);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return "";
  absl::StatusOr<std::string> out = RenderChat(*t, messages);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : "";
}

TEST(ChatTemplateTest, DetectsFamilies) {
  EXPECT_EQ(DetectChatFamily(kLlama3), ChatFamily::kLlama3);
  EXPECT_EQ(DetectChatFamily(kLlama31), ChatFamily::kLlama31);
  EXPECT_EQ(DetectChatFamily(kQwen2), ChatFamily::kChatMl);
  EXPECT_EQ(DetectChatFamily(kChatMl), ChatFamily::kChatMl);
  EXPECT_EQ(DetectChatFamily(kMistralV03), ChatFamily::kMistral);
  EXPECT_EQ(DetectChatFamily(kMistralV01), ChatFamily::kUnknown);
  EXPECT_EQ(DetectChatFamily("{{ messages }}"), ChatFamily::kUnknown);
  EXPECT_EQ(ChatFamilyName(ChatFamily::kLlama31), "llama3.1");
}

TEST(ChatTemplateTest, UnknownOrMissingTemplateIsInvalidArgument) {
  EXPECT_EQ(AnalyzeChatTemplate(kMistralV01).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AnalyzeChatTemplate("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RenderChat(ChatFamily::kUnknown, kConversation).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, Llama3) {
  EXPECT_EQ(Render(kLlama3, kConversation),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, Llama31FoldsTheSystemMessageIntoItsDatedSystemTurn) {
  EXPECT_EQ(Render(kLlama31, kConversation),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(Render(kLlama31, {{"user", "Hi"}}),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, Qwen2AddsItsDefaultSystemTurnOnlyWithoutASystemMessage) {
  EXPECT_EQ(Render(kQwen2, {{"user", "Hi"}}),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(Render(kQwen2, kConversation),
            "<|im_start|>system\n  Be brief. <|im_end|>\n<|im_start|>user\nHi there\n<|im_end|>\n"
            "<|im_start|>assistant\n Hello! <|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, PlainChatMlHasNoDefaultSystemTurn) {
  EXPECT_EQ(Render(kChatMl, {{"user", "Hi"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

// The v0.3 template trims assistant turns only: the system message keeps its spaces.
TEST(ChatTemplateTest, MistralV03FoldsTheSystemMessageIntoTheLastUserTurn) {
  EXPECT_EQ(Render(kMistralV03, kConversation),
            "<s>[INST] Hi there\n[/INST] Hello!</s>[INST]   Be brief. \n\nWhat is 2+2?[/INST]");
  EXPECT_EQ(Render(kMistralV03, {{"user", "Hi"}}), "<s>[INST] Hi[/INST]");
}

TEST(ChatTemplateTest, MistralRefusesRolesThatDoNotAlternate) {
  absl::StatusOr<ChatTemplate> t = AnalyzeChatTemplate(kMistralV03);
  ASSERT_TRUE(t.ok());
  absl::StatusOr<std::string> out = RenderChat(*t, {{"user", "a"}, {"user", "b"}});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(out.status().message()), ::testing::HasSubstr("messages[1].role"));
  EXPECT_FALSE(RenderChat(*t, {{"user", "a"}, {"system", "b"}}).ok());
  EXPECT_FALSE(RenderChat(*t, {{"assistant", "a"}}).ok());
}

TEST(ChatTemplateTest, TemplateFromTokenizerConfig) {
  EXPECT_EQ(*ChatTemplateFromTokenizerConfig(R"({"chat_template":"abc"})"), "abc");
  EXPECT_EQ(
      *ChatTemplateFromTokenizerConfig(R"({"chat_template":[{"name":"tool_use","template":"t"},)"
                                       R"({"name":"default","template":"d"}]})"),
      "d");
  EXPECT_EQ(*ChatTemplateFromTokenizerConfig(R"({"bos_token":"<s>"})"), "");
  EXPECT_EQ(ChatTemplateFromTokenizerConfig("{").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChatTemplateFromTokenizerConfig(R"({"chat_template":3})").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, BundledStrataTinyTemplateIsLlama3) {
  FILE* f = std::fopen("models/strata-tiny/tokenizer_config.json", "rb");
  ASSERT_NE(f, nullptr) << "run from the repository root (ctest does)";
  std::string json;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) json.append(buf, n);
  std::fclose(f);
  absl::StatusOr<std::string> text = ChatTemplateFromTokenizerConfig(json);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(DetectChatFamily(*text), ChatFamily::kLlama3);
  EXPECT_EQ(Render(text->c_str(), {{"user", "Hi"}}),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

}  // namespace
}  // namespace strata::router
