#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

using testing::HasSubstr;

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return "connect failed";
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string resp;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  return resp;
}

TEST(MetricsTest, HistogramsRenderCumulativeBucketsSumAndCount) {
  LatencyHistogram h;
  h.Record(10e-6);   // first bucket (<= 25 us)
  h.Record(30e-6);   // second (<= 50 us)
  h.Record(100.0);   // beyond the last bound: +Inf only
  std::string out;
  h.Render("strata_test_seconds", "op=\"get\"", true, "test latency", &out);
  EXPECT_THAT(out, HasSubstr("# TYPE strata_test_seconds histogram"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_bucket{op=\"get\",le=\"2.5e-05\"} 1\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_bucket{op=\"get\",le=\"5e-05\"} 2\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_bucket{op=\"get\",le=\"+Inf\"} 3\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_count{op=\"get\"} 3\n"));
  EXPECT_THAT(out, HasSubstr("strata_test_seconds_sum{op=\"get\"} 100.00004"));
}

TEST(MetricsTest, ServerAnswersMetricsAndRefusesOtherPaths) {
  int calls = 0;
  auto server = MetricsServer::Start("127.0.0.1", 0, [&] {
    ++calls;
    std::string out;
    RenderMetric("strata_test_total", "counter", "a test counter", 42, &out);
    return out;
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string ok = HttpGet((*server)->port(), "/metrics");
  EXPECT_THAT(ok, testing::StartsWith("HTTP/1.1 200 OK"));
  EXPECT_THAT(ok, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_THAT(ok, HasSubstr("strata_test_total 42\n"));
  EXPECT_THAT(HttpGet((*server)->port(), "/other"), testing::StartsWith("HTTP/1.1 404"));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(MetricsServer::Start("not-an-ip", 0, [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
