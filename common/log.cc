#include "common/log.h"

#include <iostream>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace strata {
namespace {

// std::mutex rather than absl::Mutex: TSan sees it (common/thread_pool.h says why).
std::mutex& LogMutex() {
  static std::mutex* const mu = new std::mutex;
  return *mu;
}
std::string& Process() {  // guarded by LogMutex()
  static std::string* const p = new std::string("strata");
  return *p;
}
std::string& Node() {  // guarded by LogMutex()
  static std::string* const n = new std::string;
  return *n;
}

}  // namespace

void SetLogIdentity(std::string process, std::string node_id) {
  std::lock_guard<std::mutex> lock(LogMutex());
  Process() = std::move(process);
  Node() = std::move(node_id);
}

void Log(absl::string_view request_id, absl::string_view message) {
  const std::string time =
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  std::lock_guard<std::mutex> lock(LogMutex());
  std::string line = absl::StrCat(time, " ", Process(), Node().empty() ? "" : " ", Node());
  if (!request_id.empty()) absl::StrAppend(&line, " [", request_id, "]");
  absl::StrAppend(&line, " ", message, "\n");
  std::cerr << line << std::flush;
}

}  // namespace strata
