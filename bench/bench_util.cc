#include "bench/bench_util.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/allocator.h"

namespace strata::bench {

std::optional<std::vector<std::pair<std::string, std::string>>> FlagPairs(int argc,
                                                                          char** argv,
                                                                          const char* usage,
                                                                          int* exit_code) {
  std::vector<std::pair<std::string, std::string>> pairs;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      *exit_code = 0;
      return std::nullopt;
    }
    const char* wrong = flag.rfind("--", 0) != 0 ? "is not a flag"
                        : i + 1 == argc           ? "wants a value"
                                                  : nullptr;
    if (wrong != nullptr) {
      std::fprintf(stderr, "%s %s\n%s", flag.c_str(), wrong, usage);
      *exit_code = 2;
      return std::nullopt;
    }
    pairs.emplace_back(flag, argv[i + 1]);
  }
  return pairs;
}

RunInfo CollectRunInfo(const std::string& commit) {
  RunInfo r;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string cpu = "unknown CPU";
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  // The allocator too: large blocks' allocation costs differ by 2x between mallocs on a VM.
  r.machine = absl::StrCat(host, " / ", cpu, " / ", std::thread::hardware_concurrency(),
                           " threads / ", strata::AllocatorName());
  const std::time_t now = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  r.date = buf;
  r.commit = commit;
  return r;
}

double MeasureReadBandwidth(int threads) {
  threads = std::max(threads, 1);
  std::vector<uint64_t> buf((512u << 20) / 8, 1);
  std::vector<uint64_t> sums(static_cast<size_t>(threads) * 8);  // a cache line per thread
  const size_t per = buf.size() / threads / 8 * 8;
  auto read = [&](int i) {
    const uint64_t* p = buf.data() + per * i;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (size_t j = 0; j < per; j += 8) {
      a0 += p[j], a1 += p[j + 1], a2 += p[j + 2], a3 += p[j + 3];
      a4 += p[j + 4], a5 += p[j + 5], a6 += p[j + 6], a7 += p[j + 7];
    }
    sums[i * 8] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
  };
  const double s = MedianSeconds(5, [&] {
    std::vector<std::thread> pool;
    for (int i = 1; i < threads; ++i) pool.emplace_back(read, i);
    read(0);
    for (std::thread& t : pool) t.join();
  });
  volatile uint64_t sink = 0;
  for (uint64_t x : sums) sink = sink + x;
  return per * threads * 8.0 / s;
}

double MeasureCopyBandwidth() {
  std::vector<uint8_t> a(512u << 20, 1), b(512u << 20, 0);
  const double s = MedianSeconds(5, [&] { std::memcpy(b.data(), a.data(), a.size()); });
  return 2.0 * a.size() / s;
}

void Json::Key(const std::string& key) {
  if (!body_.empty()) body_ += ",";
  body_ += "\"" + JsonEscape(key) + "\":";
}
Json& Json::Num(const std::string& key, double v) {
  Key(key);
  // Integers (sizes, counts) exactly; other values to 10 significant digits.
  if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15) {
    body_ += absl::StrFormat("%.0f", v);
  } else {
    body_ += absl::StrFormat("%.10g", v);
  }
  return *this;
}
Json& Json::Str(const std::string& key, const std::string& v) {
  Key(key);
  body_ += "\"" + JsonEscape(v) + "\"";
  return *this;
}
Json& Json::Raw(const std::string& key, const std::string& json) {
  Key(key);
  body_ += json;
  return *this;
}

Json ResultJson(const std::string& benchmark, const RunInfo& info) {
  Json j;
  j.Str("benchmark", benchmark).Str("machine", info.machine).Str("date", info.date)
      .Str("commit", info.commit);
  return j;
}

std::string ResultPath(const std::string& out_dir, const std::string& benchmark,
                       const RunInfo& info, const std::string& tag) {
  return absl::StrCat(out_dir, "/", benchmark, tag.empty() ? "" : "-", tag, "-",
                      info.date.substr(0, 10), "-", info.commit);
}

bool WriteResultFile(const std::string& path, const std::string& contents) {
  // The folder (--out) may not exist yet: made, as `mkdir -p` would.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) {
    std::fprintf(stderr, "cannot create %s: %s\n", parent.c_str(), ec.message().c_str());
    return false;
  }
  std::ofstream f(path);
  f << contents;
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  return true;
}

std::string JsonArray(const std::vector<std::string>& items) {
  std::string s = "[";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ",\n  " : "\n  ") + items[i];
  return s + "\n]";
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace strata::bench
