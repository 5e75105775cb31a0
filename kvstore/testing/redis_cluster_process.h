// A throwaway Redis Cluster of real redis-server processes (Debian's redis-server; scripts/
// setup.sh installs it) on free loopback ports, for tests: `masters` masters with `replicas`
// replicas each, made a cluster by `redis-cli --cluster create`, ready when every node reports
// cluster_state:ok. Masters can be killed (a failover) and every process is killed at the end.
// With `tls`, the nodes serve only TLS (tls-port; the cluster bus and replication too), with
// certificates made by the openssl command: a CA, the servers' (for 127.0.0.1 and localhost) and
// a client's, which the servers require (tls-auth-clients).
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

  RedisClusterProcess(int masters, int replicas, std::string password = "", bool tls = false)
      : masters_(masters), replicas_(replicas), password_(std::move(password)), tls_(tls) {
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

  // The TLS files (with `tls`): the CA, and the client's certificate and key.
  std::string ca_file() const { return dir_ + "/ca.crt"; }
  std::string client_cert_file() const { return dir_ + "/client.crt"; }
  std::string client_key_file() const { return dir_ + "/client.key"; }
  // A second CA that signed nothing here (a client trusting it refuses the servers).
  std::string other_ca_file() const { return dir_ + "/other-ca.crt"; }

  // Arguments every redis-server gets after the suite's own (set before Start).
  void set_extra_args(std::vector<std::string> args) { extra_args_ = std::move(args); }

  // Starts the processes and makes the cluster; false (with `why`) on failure.
  bool Start(std::string* why) {
    if (tls_ && !MakeCertificates(why)) return false;
    const int total = masters_ * (1 + replicas_);
    for (int i = 0; i < total; ++i) {
      Node n;
      n.port = FreeLoopbackPortWithPartner(10000);  // and the cluster bus at port + 10000
      std::vector<std::string> args = {kRedisServer};
      if (tls_) {
        args.insert(args.end(), {"--port", "0", "--tls-port", absl::StrCat(n.port),
                                 "--tls-cert-file", dir_ + "/redis.crt", "--tls-key-file",
                                 dir_ + "/redis.key", "--tls-ca-cert-file", ca_file(),
                                 "--tls-cluster", "yes", "--tls-replication", "yes"});
      } else {
        args.insert(args.end(), {"--port", absl::StrCat(n.port)});
      }
      args.insert(args.end(),
                  {"--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
                   absl::StrCat(dir_, "/nodes-", n.port, ".conf"), "--dir", dir_,
                   "--cluster-node-timeout", "1000",
                   // a replica always takes over from a dead master
                   "--cluster-replica-validity-factor", "0", "--repl-ping-replica-period", "1",
                   "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                   "--protected-mode", "no", "--logfile", absl::StrCat(dir_, "/", n.port, ".log")});
      if (!password_.empty()) {
        args.insert(args.end(), {"--requirepass", password_, "--masterauth", password_});
      }
      args.insert(args.end(), extra_args_.begin(), extra_args_.end());
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
    std::vector<std::string> create = {kRedisCli};
    AddTlsArgs(create);
    create.insert(create.end(), {"--cluster", "create"});
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
    AddTlsArgs(args);
    if (!password_.empty()) args.insert(args.end(), {"-a", password_});
    args.insert(args.end(), command.begin(), command.end());
    return Capture(args);
  }

 private:
  void AddTlsArgs(std::vector<std::string>& args) const {
    if (!tls_) return;
    args.insert(args.end(), {"--tls", "--cacert", ca_file(), "--cert", client_cert_file(), "--key",
                             client_key_file()});
  }
  // A CA, a server certificate for 127.0.0.1/localhost and a client certificate it signed, and
  // a second CA (P-256 keys: quick to make).
  bool MakeCertificates(std::string* why) {
    const std::string openssl = "/usr/bin/openssl";
    if (!std::filesystem::exists(openssl)) {
      *why = "no openssl command (scripts/setup.sh installs it)";
      return false;
    }
    {
      std::ofstream ext(dir_ + "/server.ext");
      ext << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    }
    auto run = [&](std::vector<std::string> args) {
      args.insert(args.begin(), openssl);
      pid_t pid = -1;
      int status = 0;
      return Spawn(args, &pid, /*quiet=*/true) && waitpid(pid, &status, 0) == pid &&
             WIFEXITED(status) && WEXITSTATUS(status) == 0;
    };
    auto key = [&](const std::string& name) {
      return std::vector<std::string>{"-newkey",
                                      "ec",
                                      "-pkeyopt",
                                      "ec_paramgen_curve:prime256v1",
                                      "-nodes",
                                      "-keyout",
                                      dir_ + "/" + name + ".key"};
    };
    auto self_signed = [&](const std::string& name) {
      std::vector<std::string> a = {"req",   "-x509",       "-days", "2",
                                    "-subj", "/CN=" + name, "-out",  dir_ + "/" + name + ".crt"};
      for (const std::string& k : key(name)) a.push_back(k);
      return run(a);
    };
    auto signed_by_ca = [&](const std::string& name, bool server) {
      std::vector<std::string> req = {"req", "-subj", "/CN=strata-" + name, "-out",
                                      dir_ + "/" + name + ".csr"};
      for (const std::string& k : key(name)) req.push_back(k);
      std::vector<std::string> sign = {"x509",
                                       "-req",
                                       "-days",
                                       "2",
                                       "-in",
                                       dir_ + "/" + name + ".csr",
                                       "-CA",
                                       ca_file(),
                                       "-CAkey",
                                       dir_ + "/ca.key",
                                       "-CAcreateserial",
                                       "-out",
                                       dir_ + "/" + name + ".crt"};
      if (server) sign.insert(sign.end(), {"-extfile", dir_ + "/server.ext"});
      return run(req) && run(sign);
    };
    if (!self_signed("ca") || !self_signed("other-ca") || !signed_by_ca("redis", true) ||
        !signed_by_ca("client", false)) {
      *why = "openssl could not make the test certificates";
      return false;
    }
    return true;
  }
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
  std::vector<std::string> extra_args_;
  bool tls_ = false;
  std::string dir_;
  std::vector<Node> nodes_;
};

}  // namespace strata::kvstore::testing
