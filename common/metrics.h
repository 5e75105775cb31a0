// Prometheus text exposition (format 0.0.4) for Strata's services: latency histograms with
// fixed exponential buckets (lock-free to record), and a tiny HTTP server that answers
// `GET /metrics` with whatever the service renders.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace strata {

class LatencyHistogram {
 public:
  // Upper bounds in seconds: 25 us x 2^i, i = 0..17 (25 us .. 3.3 s), then +Inf.
  static constexpr int kBuckets = 18;
  void Record(double seconds);
  // Appends `name_bucket{le=...}`, `name_sum`, `name_count` lines with the given labels
  // ("" or `op="get"`), after a HELP/TYPE header when `header` is set.
  void Render(const std::string& name, const std::string& labels, bool header,
              const std::string& help, std::string* out) const;

 private:
  std::array<std::atomic<uint64_t>, kBuckets + 1> counts_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_ns_{0};
};

// Appends a counter or gauge line with its HELP/TYPE header.
void RenderMetric(const std::string& name, const std::string& type, const std::string& help,
                  double value, std::string* out);

// Serves GET /metrics (and 404 for anything else) on 127.0.0.1 or 0.0.0.0 port `port` (0: any)
// from a background thread; render() is called per request. Stops on destruction.
class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port,
                                                              std::function<std::string()> render);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  void Loop();
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace strata
