#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

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

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& host, int port, std::function<std::string()> render) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->render_ = std::move(render);
  s->fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s->fd_ < 0) return absl::UnavailableError("metrics: socket() failed");
  const int one = 1;
  setsockopt(s->fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics: '", host, "' is not an IPv4 address"));
  }
  if (bind(s->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(s->fd_, 16) != 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", host, ":", port, ": ",
                                               std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(s->fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = ntohs(addr.sin_port);
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
}

void MetricsServer::Loop() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    // Read the request head (bounded; a slow or silent client gets 1 s).
    std::string req;
    char buf[1024];
    while (req.find("\r\n\r\n") == std::string::npos && req.size() < 8192) {
      pollfd q{c, POLLIN, 0};
      if (poll(&q, 1, 1000) <= 0) break;
      const ssize_t n = read(c, buf, sizeof(buf));
      if (n <= 0) break;
      req.append(buf, static_cast<size_t>(n));
    }
    std::string body, status = "200 OK";
    if (req.rfind("GET /metrics", 0) == 0) {
      body = render_();
    } else {
      status = "404 Not Found";
      body = "only GET /metrics is served here\n";
    }
    const std::string head = absl::StrCat("HTTP/1.1 ", status,
                                          "\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                          "Content-Length: ", body.size(),
                                          "\r\nConnection: close\r\n\r\n");
    const std::string all = head + body;
    size_t off = 0;
    while (off < all.size()) {
      const ssize_t n = write(c, all.data() + off, all.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    close(c);
  }
}

}  // namespace strata
