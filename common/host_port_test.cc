#include "common/host_port.h"

#include "gtest/gtest.h"

namespace strata {
namespace {

TEST(HostPortTest, ParsesNamesIpv4AndBracketedIpv6) {
  absl::StatusOr<HostPort> hp = ParseHostPort("127.0.0.1:7101");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_EQ(hp->port, 7101);
  hp = ParseHostPort("decode-0.strata.svc:0");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->host, "decode-0.strata.svc");
  EXPECT_EQ(hp->port, 0);
  hp = ParseHostPort("[::1]:65535");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->host, "::1");
  EXPECT_EQ(hp->port, 65535);
}

TEST(HostPortTest, RefusesWhatIsNotHostPortNamingIt) {
  for (const char* bad : {"127.0.0.1", ":7101", "host:", "host:x", "host:65536", "::1:80",
                          "[::1:80", "[]:80", "host:-1"}) {
    absl::StatusOr<HostPort> hp = ParseHostPort(bad);
    EXPECT_EQ(hp.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(hp.status().message().find(bad), std::string::npos) << hp.status();
  }
}

TEST(HostPortTest, JoinBracketsIpv6AndRoundTrips) {
  EXPECT_EQ(JoinHostPort("10.0.0.1", 80), "10.0.0.1:80");
  EXPECT_EQ(JoinHostPort("::1", 0), "[::1]:0");
  for (const char* a : {"10.0.0.1:80", "[fe80::1]:7101", "node:1"}) {
    absl::StatusOr<HostPort> hp = ParseHostPort(a);
    ASSERT_TRUE(hp.ok()) << a;
    EXPECT_EQ(JoinHostPort(hp->host, hp->port), a);
  }
}

}  // namespace
}  // namespace strata
