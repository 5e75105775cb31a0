// Prometheus text exposition (format 0.0.4) for the block transport's RenderMetrics: latency
// histograms with fixed exponential buckets (lock-free to record) and counter/gauge lines. The
// services serve their metrics with prometheus-cpp (an Exposer), not with code of ours; the
// transport keeps this so that it builds without it (the GPU bundle).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

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

}  // namespace strata
