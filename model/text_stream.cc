#include "model/text_stream.h"

#include <algorithm>

#include "common/utf8.h"

namespace strata::model {
namespace {

// The largest n <= end that starts a character of the well-formed UTF-8 `text`.
size_t CharBoundaryAtOrBefore(const std::string& text, size_t end) {
  while (end > 0 && end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) {
    --end;
  }
  return end;
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
  absl::StatusOr<std::string> bytes = tokenizer_->Decode({token});
  if (!bytes.ok()) return bytes.status();
  pending_ += *bytes;
  const size_t before = text_.size();
  pending_.erase(0, AppendUtf8Replacing(pending_, /*final=*/false, &text_));
  Advance(before, /*final=*/false, &p);
  return p;
}

std::string TextStream::Finish() {
  if (stopped_) return "";
  const size_t before = text_.size();
  AppendUtf8Replacing(pending_, /*final=*/true, &text_);
  pending_.clear();
  Piece p;
  Advance(before, /*final=*/true, &p);
  stopped_ = true;
  return p.text;
}

void TextStream::Advance(size_t before, bool final, Piece* p) {
  // A stop string can only newly end inside the text added since `before`.
  size_t found = std::string::npos;
  for (const std::string& s : stop_) {
    const size_t start = before >= s.size() - 1 ? before - (s.size() - 1) : 0;
    const size_t at = text_.find(s, std::max(start, emitted_));
    if (at != std::string::npos) found = std::min(found, at);
  }
  if (found != std::string::npos) {
    p->text = text_.substr(emitted_, found - emitted_);
    emitted_ = found;
    stopped_ = true;
    p->stopped = true;
    return;
  }
  // Hold back what could still begin a stop string (not at the end: nothing more comes).
  size_t end = text_.size();
  if (!final && max_stop_ > 1) end = end > max_stop_ - 1 ? end - (max_stop_ - 1) : 0;
  end = CharBoundaryAtOrBefore(text_, std::max(end, emitted_));
  p->text = text_.substr(emitted_, end - emitted_);
  emitted_ = end;
}

}  // namespace strata::model
