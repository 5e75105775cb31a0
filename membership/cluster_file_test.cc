#include "membership/cluster_file.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::membership {
namespace {

using ::testing::HasSubstr;

constexpr char kGood[] = R"({
  "model": "../models/strata-tiny",
  "codec": "kivi:k4v4:g32",
  "chunk_tokens": 64,
  "store": "127.0.0.1:7070",
  "nodes": [
    {"id": "prefill-0", "role": "prefill", "grpc": "127.0.0.1:7101", "metrics": "127.0.0.1:9101"},
    {"id": "decode-0", "role": "decode", "grpc": "127.0.0.1:7201", "transport": "127.0.0.1:7301",
     "store": "127.0.0.1:7071"}
  ],
  "router": {"http": "127.0.0.1:8000"}
})";

TEST(ClusterFileTest, ParsesNodesAndResolvesPathsAgainstTheFile) {
  absl::StatusOr<ClusterSpec> spec = ParseClusterFile(kGood, "/etc/strata/cluster.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model, "/etc/models/strata-tiny");
  EXPECT_EQ(spec->codec, "kivi:k4v4:g32");
  EXPECT_EQ(spec->chunk_tokens, 64u);
  EXPECT_EQ(spec->store, "127.0.0.1:7070");
  ASSERT_EQ(spec->nodes.size(), 2u);
  EXPECT_EQ(spec->WithRole(Role::kDecode).at(0).transport, "127.0.0.1:7301");
  ASSERT_NE(spec->Find("prefill-0"), nullptr);
  EXPECT_EQ(spec->Find("prefill-0")->metrics, "127.0.0.1:9101");
  EXPECT_EQ(spec->Find("prefill-0")->store, "");               // the cluster's
  EXPECT_EQ(spec->Find("decode-0")->store, "127.0.0.1:7071");  // its host's
  EXPECT_EQ(spec->Find("nobody"), nullptr);
  EXPECT_EQ(spec->router_http, "127.0.0.1:8000");
  EXPECT_EQ(StaticMembership(*spec).Nodes().size(), 2u);
}

struct BadCase {
  std::string text;
  std::string message;
};

TEST(ClusterFileTest, RefusesMalformedFilesNamingTheField) {
  const std::string node_p = R"({"id": "p", "role": "prefill", "grpc": "h:1"})";
  const std::string node_d = R"({"id": "d", "role": "decode", "grpc": "h:2", "transport": "h:3"})";
  auto file = [&](const std::string& extra, const std::string& nodes) {
    return R"({"model": "m")" + extra + R"(, "nodes": [)" + nodes + "]}";
  };
  const BadCase cases[] = {
      {"{", "not valid JSON"},
      {"[]", "must be a JSON object"},
      {R"({"nodes": []})", "model: is required"},
      {file(R"(, "colour": 1)", node_p + "," + node_d), "colour: unknown key"},
      {file(R"(, "chunk_tokens": -3)", node_p + "," + node_d), "chunk_tokens: must be"},
      {file(R"(, "codec": 5)", node_p + "," + node_d), "codec: must be a string"},
      {file(R"(, "store": "nowhere")", node_p + "," + node_d), "store: 'nowhere' is not host:port"},
      {file("", node_p), "no decode node"},
      {file("", node_d), "no prefill node"},
      {file("", node_p + "," + node_p + "," + node_d), "nodes[1].id: 'p' repeats"},
      {file("", R"({"id": "x", "role": "router", "grpc": "h:1"},)" + node_d), "nodes[0].role"},
      {file("", node_p + R"(, {"id": "d", "role": "decode", "grpc": "h:2"})"),
       "nodes[1].transport: '' is not host:port"},
      {file("", R"({"id": "a b", "role": "prefill", "grpc": "h:1"},)" + node_d), "nodes[0].id"},
      {file("", R"({"id": "shared-tier", "role": "prefill", "grpc": "h:1"},)" + node_d),
       "nodes[0].id: must be"},
      {file("", R"({"id": "p", "role": "prefill", "grpc": "h:99999"},)" + node_d), "nodes[0].grpc"},
      {file("", R"({"id": "p", "role": "prefill", "grpc": "h:1", "store": "h"},)" + node_d),
       "nodes[0].store: 'h' is not host:port"},
  };
  for (const BadCase& c : cases) {
    absl::StatusOr<ClusterSpec> spec = ParseClusterFile(c.text, "c.json");
    ASSERT_FALSE(spec.ok()) << c.text;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(c.message)) << c.text;
  }
}

TEST(ClusterFileTest, MissingFileIsNotFound) {
  EXPECT_EQ(LoadClusterFile("/nonexistent/cluster.json").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace strata::membership
