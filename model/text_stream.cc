#include "model/text_stream.h"

#include <algorithm>

namespace strata::model {
namespace {

// The largest n <= end such that bytes[from, n) ends on a UTF-8 character boundary.
size_t CompleteUpTo(const std::string& bytes, size_t from, size_t end) {
  size_t n = end;
  // Back up over at most 3 continuation bytes to the start of the last character.
  size_t i = n;
  int back = 0;
  while (i > from && back < 4) {
    const unsigned char c = static_cast<unsigned char>(bytes[i - 1]);
    if ((c & 0xC0) != 0x80) {  // a lead byte or ASCII
      const size_t need = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
      if (n - (i - 1) < need) n = i - 1;  // its character is not complete yet
      break;
    }
    --i;
    ++back;
  }
  return n;
}

}  // namespace

TextStream::TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop)
    : tokenizer_(tokenizer) {
  for (std::string& s : stop) {
    if (s.empty()) continue;
    max_stop_ = std::max(max_stop_, s.size());
    stop_.push_back(std::move(s));
  }
}

absl::StatusOr<TextStream::Piece> TextStream::Add(uint32_t token) {
  Piece p;
  if (stopped_) {
    p.stopped = true;
    return p;
  }
  absl::StatusOr<std::string> text = tokenizer_->Decode({token});
  if (!text.ok()) return text.status();
  const size_t before = bytes_.size();
  bytes_ += *text;
  // A stop string can only newly end inside the bytes this token added.
  size_t found = std::string::npos;
  for (const std::string& s : stop_) {
    const size_t start = before >= s.size() - 1 ? before - (s.size() - 1) : 0;
    const size_t at = bytes_.find(s, std::max(start, emitted_));
    if (at != std::string::npos) found = std::min(found, at);
  }
  if (found != std::string::npos) {
    p.text = bytes_.substr(emitted_, found - emitted_);
    emitted_ = found;
    stopped_ = true;
    p.stopped = true;
    return p;
  }
  // Hold back what could still begin a stop string, and an unfinished character.
  size_t end = bytes_.size();
  if (max_stop_ > 1) end = end > max_stop_ - 1 ? end - (max_stop_ - 1) : 0;
  end = std::max(end, emitted_);
  end = CompleteUpTo(bytes_, emitted_, end);
  p.text = bytes_.substr(emitted_, end - emitted_);
  emitted_ = end;
  return p;
}

std::string TextStream::Finish() {
  if (stopped_) return "";
  const size_t end = CompleteUpTo(bytes_, emitted_, bytes_.size());
  std::string rest = bytes_.substr(emitted_, end - emitted_);
  emitted_ = bytes_.size();
  return rest;
}

}  // namespace strata::model
