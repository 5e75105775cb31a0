// Byte-level BPE tokenizers in Hugging Face's tokenizer.json format (GPT-2, Llama 3, Qwen2 and
// most current models).
//
// Encoding: the text is split on added (special) tokens, each remaining piece is pre-tokenized
// with the Split regex of the pre_tokenizer (RE2; the look-ahead of `\s+(?!\S)`, which RE2 lacks,
// is reproduced by giving back the last whitespace character), mapped to GPT-2's byte alphabet,
// and merged by rank. Decoding maps tokens back to bytes; invalid UTF-8 in the result is kept as
// bytes (Decode returns bytes, not necessarily valid UTF-8, as a token stream can stop mid-char).
//
// Errors: kInvalidArgument naming what in tokenizer.json is missing or unsupported (a model other
// than BPE, a pre-tokenizer other than Split/ByteLevel, a regex RE2 cannot compile). Immutable
// after Load; Encode/Decode are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::model {

class Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& dir);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(absl::string_view tokenizer_json);
  ~Tokenizer();

  // `parse_special`: added tokens in the text become their ids (as in chat templates); when
  // false they are encoded as plain text.
  std::vector<uint32_t> Encode(absl::string_view text, bool parse_special = true) const;
  // kInvalidArgument for an id outside the vocabulary.
  absl::StatusOr<std::string> Decode(const std::vector<uint32_t>& ids) const;

  uint32_t vocab_size() const;
  // -1 when the tokenizer has no such token.
  int64_t TokenId(absl::string_view token) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::model
