// EtcdClient, EtcdMembership and EtcdRegistration against a real, throwaway etcd (Debian's
// etcd-server; scripts/setup.sh installs it) on free loopback ports. Skipped, saying so, when no
// etcd binary is installed.
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/testing/free_port.h"
#include "gtest/gtest.h"
#include "membership/etcd_client.h"
#include "membership/etcd_membership.h"

extern char** environ;

namespace strata::membership {
namespace {

constexpr char kEtcd[] = "/usr/bin/etcd";

int FreePort() { return FreeLoopbackPort(); }

// One etcd process; Stop and Start again on the same data and ports (a restart).
class Etcd {
 public:
  Etcd() : client_port_(FreePort()), peer_port_(FreePort()) {
    dir_ = absl::StrCat(testing::TempDir(), "/etcd-", getpid(), "-", client_port_);
    std::filesystem::remove_all(dir_);
  }
  ~Etcd() {
    Stop();
    std::filesystem::remove_all(dir_);
  }
  std::string endpoint() const { return absl::StrCat("127.0.0.1:", client_port_); }

  bool Start() {
    const std::string client = absl::StrCat("http://127.0.0.1:", client_port_);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port_);
    std::vector<std::string> args = {kEtcd,
                                     "--data-dir",
                                     dir_,
                                     "--listen-client-urls",
                                     client,
                                     "--advertise-client-urls",
                                     client,
                                     "--listen-peer-urls",
                                     peer,
                                     "--initial-advertise-peer-urls",
                                     peer,
                                     "--initial-cluster",
                                     "default=" + peer,
                                     "--heartbeat-interval",
                                     "10",
                                     "--election-timeout",
                                     "100",
                                     "--log-level",
                                     "error"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, kEtcd, nullptr, nullptr, argv.data(), environ) != 0) return false;
    auto c = NewHttpEtcdClient(endpoint(), absl::Milliseconds(500));
    for (int i = 0; i < 200; ++i) {  // ready in ~0.1 s; 10 s at most
      if (c->Put("/ready", "1", 0).ok()) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  int client_port_, peer_port_;
  std::string dir_;
  pid_t pid_ = -1;
};

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kEtcd, X_OK) != 0) GTEST_SKIP() << "skipped: no etcd at " << kEtcd;
    ASSERT_TRUE(etcd_.Start()) << "etcd did not start";
  }
  std::unique_ptr<EtcdClient> Client() { return NewHttpEtcdClient(etcd_.endpoint()); }

  Etcd etcd_;
};

NodeSpec Node(const std::string& id, Role role, int port) {
  NodeSpec n;
  n.id = id;
  n.role = role;
  n.grpc = absl::StrCat("127.0.0.1:", port);
  n.transport = role == Role::kDecode ? "127.0.0.1:0" : "";
  return n;
}

// Waits (bounded) until the membership's node ids are `want`.
bool Eventually(const EtcdMembership& m, const std::vector<std::string>& want,
                absl::Duration limit = absl::Seconds(10)) {
  const absl::Time until = absl::Now() + limit;
  while (absl::Now() < until) {
    std::vector<std::string> ids;
    for (const NodeSpec& n : m.Nodes()) ids.push_back(n.id);
    if (ids == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST_F(EtcdTest, KeyValuesLeasesAndAWatch) {
  auto c = Client();
  ASSERT_TRUE(c->Put("/t/a", "1", 0).ok());
  ASSERT_TRUE(c->Put("/t/b", std::string("\0\xff", 2), 0).ok());  // any bytes
  ASSERT_TRUE(c->Put("/u/c", "3", 0).ok());
  absl::StatusOr<EtcdRange> r = c->RangePrefix("/t/");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->kvs.size(), 2u);
  EXPECT_EQ(r->kvs[1].value, std::string("\0\xff", 2));
  EXPECT_GT(r->revision, 0);
  absl::StatusOr<int64_t> lease = c->Grant(absl::Seconds(1));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(c->Put("/t/leased", "x", *lease).ok());
  absl::StatusOr<absl::Duration> ttl = c->KeepAlive(*lease);
  ASSERT_TRUE(ttl.ok()) << ttl.status();
  EXPECT_GE(*ttl, absl::Seconds(1));
  // A watch from the range's revision sees what follows, in order, a lease's expiry included.
  std::atomic<bool> stop{false};
  std::vector<std::string> seen;
  std::mutex mu;
  std::thread watcher([&] {
    c->Watch(
         "/t/", r->revision + 1,
         [&](int64_t, const std::vector<EtcdEvent>& events) {
           std::lock_guard<std::mutex> lock(mu);
           for (const EtcdEvent& e : events) {
             seen.push_back(absl::StrCat(e.deleted ? "-" : "+", e.kv.key));
           }
         },
         stop)
        .IgnoreError();
  });
  ASSERT_TRUE(c->Delete("/t/a").ok());
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (absl::Now() < until) {  // the lease (1 s, no more renewals) expires
    std::lock_guard<std::mutex> lock(mu);
    if (seen.size() >= 3) break;
  }
  stop.store(true);
  watcher.join();
  EXPECT_EQ(seen, (std::vector<std::string>{"+/t/leased", "-/t/a", "-/t/leased"}));
  EXPECT_EQ(c->KeepAlive(*lease).status().code(), absl::StatusCode::kNotFound);
}

// Nodes register under leases; the membership follows: a node that stops deregisters at once,
// one that dies leaves within its TTL.
TEST_F(EtcdTest, MembershipFollowsRegistrationsAndLeases) {
  absl::StatusOr<std::unique_ptr<EtcdMembership>> m =
      EtcdMembership::Start(Client(), "/strata/x/", absl::ZeroDuration());
  ASSERT_TRUE(m.ok()) << m.status();
  auto p0 = EtcdRegistration::Start(Client(), "/strata/x/", Node("prefill-0", Role::kPrefill, 7010),
                                    absl::Seconds(2));
  ASSERT_TRUE(p0.ok()) << p0.status();
  auto d0 = EtcdRegistration::Start(Client(), "/strata/x/", Node("decode-0", Role::kDecode, 7030),
                                    absl::Seconds(2));
  ASSERT_TRUE(d0.ok()) << d0.status();
  ASSERT_TRUE(Eventually(**m, {"decode-0", "prefill-0"}));
  const std::vector<NodeSpec> nodes = (*m)->Nodes();
  EXPECT_EQ(nodes[0].role, Role::kDecode);
  EXPECT_EQ(nodes[1].grpc, "127.0.0.1:7010");
  // Renewed at half its TTL, the registration outlives it.
  absl::SleepFor(absl::Seconds(3));
  ASSERT_TRUE(Eventually(**m, {"decode-0", "prefill-0"}, absl::Milliseconds(10)));
  d0->reset();  // a clean stop: revoked at once
  ASSERT_TRUE(Eventually(**m, {"prefill-0"}, absl::Seconds(1)));
  // A node that dies: its lease is no longer renewed and expires.
  auto c = Client();
  absl::StatusOr<int64_t> lease = c->Grant(absl::Seconds(1));
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(
      c->Put("/strata/x/nodes/decode-9", NodeToJson(Node("decode-9", Role::kDecode, 7039)), *lease)
          .ok());
  ASSERT_TRUE(Eventually(**m, {"decode-9", "prefill-0"}, absl::Seconds(2)));
  ASSERT_TRUE(Eventually(**m, {"prefill-0"}, absl::Seconds(5)));
  // A registration that is not a node is ignored, with a log line.
  ASSERT_TRUE(c->Put("/strata/x/nodes/junk", "{not json", 0).ok());
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(Eventually(**m, {"prefill-0"}, absl::Milliseconds(10)));
}

// With a removal grace, a registration that leaves etcd stays listed that long, and one that comes
// back meanwhile (a node registering again after its lease ran out) never leaves.
TEST_F(EtcdTest, RemovalGraceKeepsANodeThatRegistersAgain) {
  absl::StatusOr<std::unique_ptr<EtcdMembership>> m =
      EtcdMembership::Start(Client(), "/g/", absl::Milliseconds(1500));
  ASSERT_TRUE(m.ok()) << m.status();
  auto c = Client();
  const std::string a = NodeToJson(Node("decode-0", Role::kDecode, 7030));
  const std::string b = NodeToJson(Node("decode-1", Role::kDecode, 7031));
  ASSERT_TRUE(c->Put("/g/nodes/decode-0", a, 0).ok());
  ASSERT_TRUE(c->Put("/g/nodes/decode-1", b, 0).ok());
  ASSERT_TRUE(Eventually(**m, {"decode-0", "decode-1"}));
  ASSERT_TRUE(c->Delete("/g/nodes/decode-0").ok());
  ASSERT_TRUE(c->Delete("/g/nodes/decode-1").ok());
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(Eventually(**m, {"decode-0", "decode-1"}, absl::Milliseconds(10)));
  ASSERT_TRUE(c->Put("/g/nodes/decode-0", a, 0).ok());  // back within the grace
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(Eventually(**m, {"decode-0"}, absl::Seconds(2)));
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(Eventually(**m, {"decode-0"}, absl::Milliseconds(10)));
}

// etcd lost: the membership stays as it was; back: the watch resumes, and a registration whose
// lease expired meanwhile is made again.
TEST_F(EtcdTest, EtcdLostAndBack) {
  absl::StatusOr<std::unique_ptr<EtcdMembership>> m = EtcdMembership::Start(Client(), "/s/");
  ASSERT_TRUE(m.ok()) << m.status();
  auto p0 = EtcdRegistration::Start(Client(), "/s/", Node("prefill-0", Role::kPrefill, 7010),
                                    absl::Seconds(1));
  ASSERT_TRUE(p0.ok()) << p0.status();
  ASSERT_TRUE(Eventually(**m, {"prefill-0"}));
  etcd_.Stop();
  absl::SleepFor(absl::Seconds(2));
  EXPECT_FALSE((*m)->connected());
  EXPECT_TRUE(Eventually(**m, {"prefill-0"}, absl::Milliseconds(10)));  // kept while etcd is away
  ASSERT_TRUE(etcd_.Start());
  auto d1 = EtcdRegistration::Start(Client(), "/s/", Node("decode-1", Role::kDecode, 7031),
                                    absl::Seconds(2));
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_TRUE(Eventually(**m, {"decode-1", "prefill-0"}, absl::Seconds(10)));
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (!(*m)->connected() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE((*m)->connected());
}

TEST(NodeJsonTest, RoundTripsAndRefusesBadRegistrations) {
  NodeSpec n = Node("decode-3", Role::kDecode, 7033);
  n.metrics = "127.0.0.1:7053";
  n.store = "10.0.0.3:7070";
  absl::StatusOr<NodeSpec> back = NodeFromJson(NodeToJson(n));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, n.id);
  EXPECT_EQ(back->role, n.role);
  EXPECT_EQ(back->grpc, n.grpc);
  EXPECT_EQ(back->transport, n.transport);
  EXPECT_EQ(back->metrics, n.metrics);
  EXPECT_EQ(back->store, n.store);
  EXPECT_FALSE(NodeFromJson("[1]").ok());
  EXPECT_FALSE(NodeFromJson(R"({"id":"a b","role":"decode","grpc":"h:1"})").ok());
  EXPECT_FALSE(NodeFromJson(R"({"id":"a","role":"cook","grpc":"h:1"})").ok());
  EXPECT_FALSE(NodeFromJson(R"({"id":"a","role":"decode","grpc":"nohost"})").ok());
  EXPECT_FALSE(NodeFromJson(R"({"id":"a","role":"decode","grpc":"h:1","store":"h"})").ok());
}

// Stores register beside the nodes: the membership lists them (and still only nodes as nodes),
// a node's `--store host` finds the one on its own host, and a store that stops leaves.
TEST_F(EtcdTest, StoresRegisterAndANodeFindsItsHostsStore) {
  absl::StatusOr<std::unique_ptr<EtcdMembership>> m =
      EtcdMembership::Start(Client(), "/s/", absl::ZeroDuration());
  ASSERT_TRUE(m.ok()) << m.status();
  auto node = EtcdRegistration::Start(Client(), "/s/", Node("prefill-0", Role::kPrefill, 7010),
                                      absl::Seconds(2));
  ASSERT_TRUE(node.ok()) << node.status();
  absl::StatusOr<StoreSpec> a = StoreSpecFromFlags("10.0.0.1:0", 7070, "", "", "10.0.0.1:7071");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->id, "store-10.0.0.1-7070");
  EXPECT_EQ(a->grpc, "10.0.0.1:7070");
  auto ra = EtcdRegistration::StartStore(Client(), "/s/", *a, absl::Seconds(2));
  ASSERT_TRUE(ra.ok()) << ra.status();
  auto rb = EtcdRegistration::StartStore(
      Client(), "/s/", {.id = "store-b", .grpc = "10.0.0.2:7070"}, absl::Seconds(2));
  ASSERT_TRUE(rb.ok()) << rb.status();
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((*m)->Stores().size() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  const std::vector<StoreSpec> stores = (*m)->Stores();
  ASSERT_EQ(stores.size(), 2u);
  EXPECT_EQ(stores[0], *a);
  EXPECT_EQ(stores[1].id, "store-b");
  EXPECT_TRUE(Eventually(**m, {"prefill-0"}, absl::Milliseconds(10)));  // stores are not nodes
  auto c = Client();
  absl::StatusOr<StoreSpec> mine = HostStore(*c, "/s/", "10.0.0.2", absl::ZeroDuration());
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->grpc, "10.0.0.2:7070");
  absl::StatusOr<StoreSpec> none = HostStore(*c, "/s/", "10.0.0.9", absl::Milliseconds(300));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("store-b at 10.0.0.2:7070"), std::string::npos)
      << none.status();
  // Two stores on one host: the node must be told which.
  auto rc = EtcdRegistration::StartStore(
      Client(), "/s/", {.id = "store-c", .grpc = "10.0.0.2:7080"}, absl::Seconds(2));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(HostStore(*c, "/s/", "10.0.0.2", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A store that stops leaves at once; a node waiting for its host's store finds one that
  // registers meanwhile.
  rc->reset();
  rb->reset();
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(500));
    auto again = EtcdRegistration::StartStore(
        Client(), "/s/", {.id = "store-b", .grpc = "10.0.0.2:7070"}, absl::Seconds(2));
    EXPECT_TRUE(again.ok());
    absl::SleepFor(absl::Seconds(1));
  });
  absl::StatusOr<StoreSpec> waited = HostStore(*c, "/s/", "10.0.0.2", absl::Seconds(10));
  later.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->id, "store-b");
  // A wildcard listen address cannot be registered without --advertise.
  EXPECT_EQ(StoreSpecFromFlags("0.0.0.0:7070", 7070, "", "", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StoreSpecFromFlags("0.0.0.0:7070", 7070, "10.0.0.5:7070", "", "")->grpc,
            "10.0.0.5:7070");
  EXPECT_FALSE(StoreFromJson(R"({"id":"s","grpc":"nohost"})").ok());
  EXPECT_FALSE(StoreFromJson(R"({"id":"bad id","grpc":"h:1"})").ok());
}

// Where addresses do not name machines (Kubernetes: a store pod and a node pod on one machine
// have addresses of their own), a store registers the machine's name and nodes match that.
TEST_F(EtcdTest, AStoreRegisteredForAMachineByNameIsThatMachinesStore) {
  absl::StatusOr<StoreSpec> a =
      StoreSpecFromFlags("0.0.0.0:7700", 7700, "10.1.0.7:7700", "store-a", "", "worker-3");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(StoreHost(*a), "worker-3");
  EXPECT_EQ(StoreHost({.id = "b", .grpc = "10.1.0.9:7700"}), "10.1.0.9");
  // The name travels through etcd's JSON and back.
  absl::StatusOr<StoreSpec> back = StoreFromJson(StoreToJson(*a));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *a);
  auto ra = EtcdRegistration::StartStore(Client(), "/m/", *a, absl::Seconds(2));
  ASSERT_TRUE(ra.ok()) << ra.status();
  auto rb = EtcdRegistration::StartStore(
      Client(), "/m/", {.id = "store-b", .grpc = "10.1.0.9:7700", .host = "worker-4"},
      absl::Seconds(2));
  ASSERT_TRUE(rb.ok()) << rb.status();
  auto c = Client();
  absl::StatusOr<StoreSpec> mine = HostStore(*c, "/m/", "worker-3", absl::Seconds(5));
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->grpc, "10.1.0.7:7700");
  // Its address no longer names its machine: a node looking by address finds no store there.
  EXPECT_EQ(HostStore(*c, "/m/", "10.1.0.7", absl::Milliseconds(200)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(StoreFromJson(
                   absl::StrCat(R"({"id":"s","grpc":"h:1","host":")", std::string(300, 'x'), "\"}"))
                   .ok());
}

}  // namespace
}  // namespace strata::membership
