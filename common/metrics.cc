#include "common/metrics.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace strata {
namespace {

double BucketBound(int i) { return 25e-6 * std::ldexp(1.0, i); }

}  // namespace

void LatencyHistogram::Record(double seconds) {
  int i = 0;
  while (i < kBuckets && seconds > BucketBound(i)) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<uint64_t>(std::max(0.0, seconds) * 1e9), std::memory_order_relaxed);
}

void LatencyHistogram::Render(const std::string& name, const std::string& labels, bool header,
                              const std::string& help, std::string* out) const {
  if (header) absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  const std::string sep = labels.empty() ? "" : ",";
  uint64_t cumulative = 0;
  for (int i = 0; i <= kBuckets; ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    const std::string le = i == kBuckets ? "+Inf" : absl::StrFormat("%g", BucketBound(i));
    absl::StrAppend(out, name, "_bucket{", labels, sep, "le=\"", le, "\"} ", cumulative, "\n");
  }
  const std::string braces = labels.empty() ? "" : absl::StrCat("{", labels, "}");
  absl::StrAppend(out, name, "_sum", braces, " ",
                  absl::StrFormat("%.9f", sum_ns_.load(std::memory_order_relaxed) / 1e9), "\n");
  absl::StrAppend(out, name, "_count", braces, " ", count_.load(std::memory_order_relaxed), "\n");
}

void RenderMetric(const std::string& name, const std::string& type, const std::string& help,
                  double value, std::string* out) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ",
                  absl::StrFormat("%.17g", value), "\n");
}

}  // namespace strata
