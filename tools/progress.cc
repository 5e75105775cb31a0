#include "tools/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace strata::tools {
namespace {

std::string Short(absl::Duration d) {
  const int64_t s = std::max<int64_t>(0, absl::ToInt64Seconds(d));
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

}  // namespace

Progress::Progress(std::string what, size_t total, std::ostream* err, int tty,
                   absl::Duration interval)
    : what_(std::move(what)),
      total_(total),
      err_(err != nullptr ? err : &std::cerr),
      tty_(tty >= 0 ? tty != 0 : isatty(STDERR_FILENO) == 1),
      interval_(interval),
      start_(absl::Now()) {
  Print(true);
}

std::string Progress::Line(absl::string_view what, size_t done, size_t total,
                           absl::Duration elapsed, absl::string_view detail, bool bar) {
  std::string line = absl::StrCat(what, ": ");
  const double f = total > 0 ? std::min(1.0, static_cast<double>(done) / total) : 1.0;
  if (bar) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(std::floor(f * kWidth));
    absl::StrAppend(&line, "[", std::string(filled, '#'), std::string(kWidth - filled, '.'), "] ");
  }
  absl::StrAppend(&line, done, "/", total, " (", static_cast<int>(std::floor(100 * f)), "%) ",
                  Short(elapsed));
  if (done > 0 && done < total) {
    absl::StrAppend(&line, ", about ", Short(elapsed / static_cast<double>(done) * (total - done)),
                    " left");
  }
  if (!detail.empty()) absl::StrAppend(&line, ": ", detail);
  return line;
}

void Progress::Advance(size_t n, absl::string_view detail) {
  done_ += n;
  detail_ = std::string(detail);
  Print(false);
}

void Progress::Done() {
  if (finished_) return;
  finished_ = true;
  Print(true);
  if (tty_) *err_ << "\n" << std::flush;
}

void Progress::Print(bool force) {
  const absl::Time now = absl::Now();
  if (!tty_ && !force && now - last_print_ < interval_) return;
  last_print_ = now;
  const std::string line = Line(what_, done_, total_, now - start_, detail_, tty_);
  if (tty_) {
    *err_ << "\r" << line << "\x1b[K" << std::flush;  // redrawn in place, the rest cleared
  } else {
    *err_ << line << "\n" << std::flush;
  }
}

}  // namespace strata::tools
