// Progress of a long command (strata eval, calibrate, replay) on stderr. On a terminal: a bar
// with the count, the elapsed time and an estimate of what is left, redrawn in place. Otherwise
// (a log, a pipe): one line at most every `interval`, and one when done, so that a job that runs
// for minutes is never silent.
//
//   Progress p("eval", codecs.size());
//   for (...) { ...; p.Advance(1, spec); }
//   p.Done();
#pragma once

#include <cstddef>
#include <ostream>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace strata::tools {

class Progress {
 public:
  // `tty`: draw a bar (default: whether stderr is a terminal).
  Progress(std::string what, size_t total, std::ostream* err = nullptr, int tty = -1,
           absl::Duration interval = absl::Seconds(5));
  ~Progress() { Done(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // `n` more steps done; `detail` names the last one (a codec, a layer).
  void Advance(size_t n = 1, absl::string_view detail = "");
  // The last line (once).
  void Done();

  // One line: "eval: [#######.............] 3/7 (43%) 1m12s, about 1m36s left: kivi:k2v2".
  // The estimate is the mean time per step so far times the steps left (none before a step).
  static std::string Line(absl::string_view what, size_t done, size_t total,
                          absl::Duration elapsed, absl::string_view detail, bool bar);

 private:
  void Print(bool force);

  const std::string what_;
  const size_t total_;
  std::ostream* const err_;
  const bool tty_;
  const absl::Duration interval_;
  const absl::Time start_;
  absl::Time last_print_ = absl::InfinitePast();
  size_t done_ = 0;
  std::string detail_;
  bool finished_ = false;
};

}  // namespace strata::tools
