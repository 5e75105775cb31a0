// Helpers for Strata's end-to-end benchmark programs: run metadata (machine, date, commit) and a
// small JSON writer, so every program's results land in bench/results/ in one shape.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace strata::bench {

// A program's command line as (--flag, value) pairs. `--help` (or `-h`) prints `usage` to stdout
// and sets *exit_code to 0; a flag without its value, or an argument that is not a flag, prints
// what is wrong and `usage` to stderr and sets it to 2. Either way the caller returns it.
std::optional<std::vector<std::pair<std::string, std::string>>> FlagPairs(int argc,
                                                                          char** argv,
                                                                          const char* usage,
                                                                          int* exit_code);

struct RunInfo {
  std::string machine;  // host, CPU model, cores
  std::string date;     // UTC, ISO 8601
  std::string commit;   // as given by the caller (scripts/bench.sh passes git's)
};

RunInfo CollectRunInfo(const std::string& commit);

// Median wall time in seconds of `fn` over `reps` runs after one warm-up run.
template <typename F>
double MedianSeconds(int reps, F&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Streaming read bandwidth (bytes/s) over a buffer far larger than the caches, read by `threads`
// threads at once (each its own slice; compare a kernel with the same thread count), and memcpy
// bandwidth (bytes read + written per second, one thread), measured now.
double MeasureReadBandwidth(int threads = 1);
double MeasureCopyBandwidth();

// Minimal JSON building: values are written as given (numbers) or quoted (strings).
class Json {
 public:
  Json& Num(const std::string& key, double v);
  Json& Str(const std::string& key, const std::string& v);
  Json& Raw(const std::string& key, const std::string& json);
  std::string Done() const { return "{" + body_ + "}"; }

 private:
  void Key(const std::string& key);
  std::string body_;
};

std::string JsonArray(const std::vector<std::string>& items);
std::string JsonEscape(const std::string& s);

// A result file's first fields: benchmark, machine, date, commit.
Json ResultJson(const std::string& benchmark, const RunInfo& info);

// OUT_DIR/BENCHMARK[-TAG]-YYYY-MM-DD-COMMIT, without extension: where a program's results go.
std::string ResultPath(const std::string& out_dir, const std::string& benchmark,
                       const RunInfo& info, const std::string& tag = "");

// Writes `contents` to `path`; false, and a line on stderr, when it cannot.
bool WriteResultFile(const std::string& path, const std::string& contents);

}  // namespace strata::bench
