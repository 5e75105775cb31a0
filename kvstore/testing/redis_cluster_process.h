// A throwaway Redis Cluster of real redis-server processes (Debian's redis-server; scripts/
// setup.sh installs it) on free loopback ports, for tests: `masters` masters with `replicas`
// replicas each, made a cluster by `redis-cli --cluster create`, ready when every node reports
// cluster_state:ok. Masters can be killed (a failover) and every process is killed at the end.
// For tests and benchmarks (shared_tier_bench); never in a product binary.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/testing/free_port.h"
#include "kvstore/redis_cluster.h"

extern char** environ;

namespace strata::kvstore::testing {

inline constexpr char kRedisServer[] = "/usr/bin/redis-server";
inline constexpr char kRedisCli[] = "/usr/bin/redis-cli";

class RedisClusterProcess {
 public:
  struct Node {
    int port = 0;
    pid_t pid = -1;
  };

  RedisClusterProcess(int masters, int replicas, std::string password = "")
      : masters_(masters), replicas_(replicas), password_(std::move(password)) {
    dir_ = absl::StrCat(std::filesystem::temp_directory_path().string(), "/redis-cluster-",
                        getpid(), "-", FreeLoopbackPort());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~RedisClusterProcess() {
    for (Node& n : nodes_) Kill(n);
    std::filesystem::remove_all(dir_);
  }
  static bool Installed() {
    return std::filesystem::exists(kRedisServer) && std::filesystem::exists(kRedisCli);
  }

  // Starts the processes and makes the cluster; false (with `why`) on failure.
  bool Start(std::string* why) {
    const int total = masters_ * (1 + replicas_);
    for (int i = 0; i < total; ++i) {
      Node n;
      n.port = FreeLoopbackPortWithPartner(10000);  // and the cluster bus at port + 10000
      std::vector<std::string> args = {
          kRedisServer, "--port", absl::StrCat(n.port), "--bind", "127.0.0.1", "--cluster-enabled",
          "yes", "--cluster-config-file", absl::StrCat(dir_, "/nodes-", n.port, ".conf"), "--dir",
          dir_, "--cluster-node-timeout", "1000",
          // a replica always takes over from a dead master
          "--cluster-replica-validity-factor", "0", "--repl-ping-replica-period", "1", "--save", "",
          "--appendonly", "no", "--repl-diskless-sync-delay", "0", "--protected-mode", "no",
          "--logfile", absl::StrCat(dir_, "/", n.port, ".log")};
      if (!password_.empty()) {
        args.insert(args.end(), {"--requirepass", password_, "--masterauth", password_});
      }
      if (!Spawn(args, &n.pid)) {
        *why = "cannot start redis-server";
        return false;
      }
      nodes_.push_back(n);
    }
    for (Node& n : nodes_) {
      if (!WaitPing(n.port)) {
        *why = absl::StrCat("redis-server on ", n.port, " did not answer PING");
        return false;
      }
    }
    std::vector<std::string> create = {kRedisCli, "--cluster", "create"};
    for (Node& n : nodes_) create.push_back(absl::StrCat("127.0.0.1:", n.port));
    create.insert(create.end(), {"--cluster-replicas", absl::StrCat(replicas_), "--cluster-yes"});
    if (!password_.empty()) create.insert(create.end(), {"-a", password_, "--no-auth-warning"});
    pid_t pid = -1;
    if (!Spawn(create, &pid, /*quiet=*/true)) {
      *why = "cannot run redis-cli --cluster create";
      return false;
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      *why = "redis-cli --cluster create failed";
      return false;
    }
    for (int i = 0; i < 300; ++i) {  // every node agrees: about 1-2 s
      bool ok = true;
      for (Node& n : nodes_)
        ok = ok && Cli(n.port, {"CLUSTER", "INFO"}).find("cluster_state:ok") != std::string::npos;
      if (ok) break;
      if (i == 299) {
        *why = "the cluster did not reach cluster_state:ok";
        return false;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    // Every replica attached and synchronized (a replica that never finished its first sync will
    // not take over from its master).
    for (int i = 0; i < 400; ++i) {
      int online = 0;
      for (Node& n : nodes_) {
        const std::string info = Cli(n.port, {"INFO", "replication"});
        for (size_t at = info.find("state=online"); at != std::string::npos;
             at = info.find("state=online", at + 1)) {
          ++online;
        }
      }
      if (online == masters_ * replicas_) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    *why = "the replicas did not all come online";
    return false;
  }

  std::string seed() const { return absl::StrCat("127.0.0.1:", nodes_[0].port); }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::string& password() const { return password_; }

  // A node's port by "host:port".
  Node* Find(const std::string& addr) {
    for (Node& n : nodes_) {
      if (addr == absl::StrCat("127.0.0.1:", n.port)) return &n;
    }
    return nullptr;
  }
  void Kill(Node& n) {
    if (n.pid <= 0) return;
    kill(n.pid, SIGKILL);
    waitpid(n.pid, nullptr, 0);
    n.pid = -1;
  }

  // Runs one command on one node (redis-cli's own connection) and returns its output.
  std::string Cli(int port, const std::vector<std::string>& command) {
    std::vector<std::string> args = {kRedisCli, "-p", absl::StrCat(port), "--no-auth-warning"};
    if (!password_.empty()) args.insert(args.end(), {"-a", password_});
    args.insert(args.end(), command.begin(), command.end());
    return Capture(args);
  }

 private:
  bool Spawn(std::vector<std::string> args, pid_t* pid, bool quiet = false) {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (quiet) {
      posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
      posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    }
    const int rc = posix_spawn(pid, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    return rc == 0;
  }
  std::string Capture(std::vector<std::string> args) {
    const std::string out = absl::StrCat(dir_, "/out-", FreeLoopbackPort());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    pid_t pid = -1;
    std::string text;
    if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) == 0) {
      waitpid(pid, nullptr, 0);
      std::ifstream in(out);
      text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    posix_spawn_file_actions_destroy(&fa);
    std::filesystem::remove(out);
    return text;
  }
  bool WaitPing(int port) {
    for (int i = 0; i < 200; ++i) {
      if (absl::StrContains(Cli(port, {"PING"}), "PONG")) return true;
      absl::SleepFor(absl::Milliseconds(25));
    }
    return false;
  }

  int masters_, replicas_;
  std::string password_;
  std::string dir_;
  std::vector<Node> nodes_;
};

}  // namespace strata::kvstore::testing
