// transport_bench: the block shipping protocol over UCX between two processes on this machine —
// throughput against block size (4 KiB .. 64 MiB) and small-block latency — with ucx_perftest
// (Debian's ucx-utils) on the same UCX transports measured in the same run as the ceiling.
//
// Strata's numbers include everything the protocol does: a header per block, the payload placed
// into the receiver's registered buffer, the receiver's CRC-32C verification of every block, and
// an acknowledgement per block (a transfer completes when the receiver has verified it). The
// sender passes each block's CRC-32C as a prefill node does (computed once, when the block is
// encoded). ucx_perftest's ucp_am_bw moves the same sizes as UCP active messages with no checks.
//
// Prints a table and writes JSON (and the same table as .txt) to --out (default bench/results).
// Flags: kUsage below (--help).
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/byte_size.h"
#include "common/crc32c.h"
#include "common/host_port.h"
#include "common/testing/free_port.h"
#include "transport/block_protocol.h"
#include "transport/ucx/ucx_transport.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;
using transport::BlockReceiver;
using transport::BlockSender;
using transport::Payload;
using transport::Transfer;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

uint64_t ParseSize(const std::string& s) {
  uint64_t v = 0;
  if (!ParseByteSize(s, &v)) {
    std::fprintf(stderr, "bad size '%s' (a count with an optional K/M/G/T suffix)\n", s.c_str());
    std::exit(2);
  }
  return v;
}

std::string HumanSize(uint64_t n) {
  if (n >= (1 << 20) && n % (1 << 20) == 0) return absl::StrCat(n >> 20, "M");
  if (n >= 1024 && n % 1024 == 0) return absl::StrCat(n >> 10, "K");
  return absl::StrCat(n);
}

uint16_t FreePort() { return FreeLoopbackPort(); }

// ---- the receiving process -------------------------------------------------------------------

constexpr uint16_t kRawMessage = 40;  // transport_bench's own message ids, beside the protocol's
constexpr uint16_t kRawRingMessage = 41;

// Listens on `listen` (HOST:PORT; default loopback, any port) and writes its address to
// `address_file`, or prints it when there is none (a receiver on another host).
int RunReceiver(const std::string& tls, const std::string& address_file, uint64_t inline_max,
                int64_t busy_us, uint64_t ring_bytes, const std::string& listen) {
  transport::UcxTransportOptions o{.tls = tls, .busy_poll = absl::Microseconds(busy_us)};
  if (!listen.empty()) {
    absl::StatusOr<HostPort> hp = ParseHostPort(listen);
    if (!hp.ok() || hp->port == 0) {
      std::fprintf(stderr, "--listen wants HOST:PORT, got '%s'\n", listen.c_str());
      return 2;
    }
    o.listen_host = hp->host;
    o.listen_port = hp->port;
  }
  auto t = transport::CreateUcxTransport(o);
  if (!t.ok()) {
    std::fprintf(stderr, "receiver: %s\n", t.status().ToString().c_str());
    return 1;
  }
  auto r = BlockReceiver::Create(t->get(),
                                 {.pool_bytes = uint64_t{1} << 30,
                                  .inline_max_bytes = inline_max,
                                  .ring_bytes = ring_bytes},
                                 [](transport::ReceivedBlock) { return absl::OkStatus(); });
  if (!r.ok()) return 1;
  // Raw messages (no protocol): every payload lands in one buffer, which stays in cache, and
  // nothing is checked or acknowledged — what ucx_perftest's receiver does.
  auto raw_buf = (*t)->Allocate(uint64_t{64} << 20, transport::MemoryKind::kHost);
  if (!raw_buf.ok()) return 1;
  transport::MemoryRegion* raw = raw_buf->get();
  (*t)->SetHandler(kRawMessage, [raw](transport::IncomingMessage& m) {
    if (m.payload_size() > raw->size()) return;
    m.Accept({.bytes = {raw->data(), m.payload_size()}, .region = raw}, [](absl::Status) {});
  });
  // The same, but each message lands in the next slot of a 256 MiB ring, as blocks land in
  // distinct pool buffers: memory that is not in cache.
  auto ring_buf = (*t)->Allocate(uint64_t{256} << 20, transport::MemoryKind::kHost);
  if (!ring_buf.ok()) return 1;
  transport::MemoryRegion* ring = ring_buf->get();
  auto next = std::make_shared<uint64_t>(0);
  (*t)->SetHandler(kRawRingMessage, [ring, next](transport::IncomingMessage& m) {
    const uint64_t n = m.payload_size();
    if (n > ring->size()) return;
    const uint64_t slots = ring->size() / std::max<uint64_t>(n, 4096);
    const uint64_t at = ((*next)++ % slots) * std::max<uint64_t>(n, 4096);
    m.Accept({.bytes = {ring->data() + at, n}, .region = ring}, [](absl::Status) {});
  });
  if (address_file.empty()) {
    std::printf("receiving at %s (UCX_TLS=%s); stop with Ctrl-C\n", (*t)->address().c_str(),
                tls.c_str());
    std::fflush(stdout);
  } else {
    {
      std::ofstream(address_file + ".tmp") << (*t)->address() << std::flush;
    }
    std::filesystem::rename(address_file + ".tmp", address_file);
  }
  for (;;) pause();  // until SIGTERM (the parent's) or SIGINT
}

// ---- ucx_perftest ----------------------------------------------------------------------------

struct PerftestResult {
  bool ok = false;
  double bandwidth = 0;   // bytes/s (overall)
  double latency_us = 0;  // one-way, median
  std::string error;
};

// Runs `ucx_perftest -t TEST` server and client on loopback; parses the client's "Final:" line
// (iterations, overhead 50%/avg/overall us, bandwidth avg/overall MiB/s, msg rate avg/overall).
// `env` is extra UCX settings ("UCX_A=x UCX_B=y"); `errors` adds -e (peer error handling on
// every endpoint, as Strata's endpoints have).
PerftestResult RunPerftest(const std::string& perftest, const std::string& tls,
                           const std::string& env, bool errors, const std::string& test,
                           uint64_t size, uint64_t iters) {
  PerftestResult res;
  const uint16_t port = FreePort();
  const pid_t server = fork();
  if (server == 0) {
    setenv("UCX_TLS", tls.c_str(), 1);
    for (absl::string_view kv : absl::StrSplit(env, ' ', absl::SkipEmpty())) {
      std::vector<std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      if (p.size() == 2) setenv(p[0].c_str(), p[1].c_str(), 1);
    }
    const int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    if (errors) {
      execl(perftest.c_str(), perftest.c_str(), "-p", std::to_string(port).c_str(), "-e", nullptr);
    } else {
      execl(perftest.c_str(), perftest.c_str(), "-p", std::to_string(port).c_str(), nullptr);
    }
    _exit(127);
  }
  std::string out;
  for (int attempt = 0; attempt < 20 && out.find("Final:") == std::string::npos; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const std::string cmd =
        absl::StrCat("UCX_TLS=", tls, " ", env, " ", perftest, " 127.0.0.1 -p ", port,
                     errors ? " -e" : "", " -t ", test, " -s ", size, " -n ", iters, " -w ",
                     std::max<uint64_t>(iters / 10, 10), " 2>&1");
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) break;
    char buf[4096];
    out.clear();
    while (fgets(buf, sizeof(buf), p) != nullptr) out += buf;
    pclose(p);
  }
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  const size_t at = out.find("Final:");
  if (at == std::string::npos) {
    res.error = out.substr(0, 300);
    return res;
  }
  std::istringstream line(out.substr(at + 6));
  double iters_done, lat50, lat_avg, lat_all, bw_avg, bw_all;
  if (!(line >> iters_done >> lat50 >> lat_avg >> lat_all >> bw_avg >> bw_all)) {
    res.error = "unparsable: " + out.substr(at, 200);
    return res;
  }
  res.ok = true;
  res.bandwidth = bw_all * 1024 * 1024;
  res.latency_us = lat50;
  return res;
}

// ---- the sending side ------------------------------------------------------------------------

// Sends `n` raw messages (no protocol) with at most `window` bytes outstanding; bytes/s until the
// last one completes (for rendezvous sizes: until the receiver has fetched it).
double RawRound(transport::Endpoint& ep, const Payload& payload, uint64_t n, uint64_t window,
                uint16_t id = kRawMessage) {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t outstanding = 0, done = 0;
  absl::Status failed;
  const uint64_t size = payload.bytes.size();
  const auto a = Clock::now();
  for (uint64_t i = 0; i < n; ++i) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return outstanding == 0 || outstanding + size <= window; });
      outstanding += size;
    }
    ep.Send(id, {}, payload, absl::Seconds(30), [&](absl::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      if (!s.ok()) failed = s;
      outstanding -= size;
      ++done;
      cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done == n; });
  if (!failed.ok()) {
    std::cerr << "raw UCX round failed: " << failed << "\n";
    std::exit(1);
  }
  return size * n / Seconds(a, Clock::now());
}

std::string NumArray(const std::vector<double>& v) {
  std::vector<std::string> items;
  for (double x : v) items.push_back(absl::StrFormat("%.0f", x));
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

struct Row {
  uint64_t size = 0;
  uint64_t blocks = 0;
  double strata_bw = 0;      // bytes/s
  double perftest_bw = 0;        // bytes/s, endpoints configured as Strata's (0: not measured)
  double perftest_plain_bw = 0;  // bytes/s, UCX's defaults without peer error handling
  double strata_median = 0, perftest_median = 0, perftest_plain_median = 0;
  double raw_bw = 0, raw_median = 0;  // raw UCX messages on Strata's connection (no protocol)
  uint64_t placed = 0;                // of Strata's blocks (warm-up included), directly placed
  double raw_ring_bw = 0;             // the same, landing in a 256 MiB ring (not in cache)
  uint64_t window = 0;  // the sender's bytes in flight
  std::string perftest_error;
  std::vector<double> strata_rounds, perftest_rounds;  // bytes/s, every round in order
};

constexpr char kUsage[] =
    "usage: transport_bench [--tls LIST] [--sizes 4K,64K,...] [--mib N] [--reps N]\n"
    "         [--window BYTES] [--inline BYTES] [--busy-poll-us N] [--perftest PATH]\n"
    "         [--place-min BYTES (0: no direct placement)] [--stream-min BYTES (0: never)]\n"
    "         [--ring BYTES (the receiver's ring_bytes)] [--piece BYTES (0: whole)]\n"
    "         [--commit SHA] [--out DIR (default bench/results)]\n"
    "between two hosts (no ucx_perftest comparison then; run it yourself for the ceiling):\n"
    "  host A: transport_bench --role receiver --listen 0.0.0.0:7080 [--tls LIST]\n"
    "  host B: transport_bench --connect ucx://A:7080 [--tls LIST] [other flags as above]\n";

int Main(int argc, char** argv) {
  std::string tls = "posix,sysv,cma,tcp", commit = "unknown", out_dir = "bench/results";
  std::string perftest = "/usr/bin/ucx_perftest", role, address_file, listen, connect;
  std::vector<uint64_t> sizes = {4 << 10,  16 << 10, 64 << 10, 256 << 10,
                                 1 << 20,  4 << 20,  16 << 20, 64 << 20};
  uint64_t mib = 1024;
  int reps = 5;
  uint64_t window = 0;  // 0: per size, max(2 blocks, 16 MiB)
  // The receiver verifies and consumes blocks up to this size on its transport thread (its
  // consumer here only drops the block, as a decode node hands it to its KV cache).
  uint64_t inline_max = 4 << 20;
  int64_t busy_us = 50;  // UcxTransportOptions::busy_poll, both sides
  // BlockSenderOptions::placement_min_bytes: direct placement into the receiver's ring for
  // blocks this large (0: never, every block as payload through UCX).
  uint64_t place_min = transport::BlockSenderOptions{}.placement_min_bytes;
  uint64_t stream_min = transport::BlockSenderOptions{}.stream_min_bytes;  // 0: never
  uint64_t piece = transport::BlockSenderOptions{}.piece_bytes;  // 0: whole
  uint64_t ring = transport::BlockReceiverOptions{}.ring_bytes;  // lent to the sender
  int exit_code = 0;
  const auto flags = FlagPairs(argc, argv, kUsage, &exit_code);
  if (!flags) return exit_code;
  for (const auto& [f, v] : *flags) {
    if (f == "--tls") tls = v;
    else if (f == "--commit") commit = v;
    else if (f == "--out") out_dir = v;
    else if (f == "--perftest") perftest = v;
    else if (f == "--role") role = v;
    else if (f == "--address-file") address_file = v;
    else if (f == "--listen") listen = v;
    else if (f == "--connect") connect = v;
    else if (f == "--mib") mib = ParseSize(v);
    else if (f == "--reps") reps = std::max(1, std::atoi(v.c_str()));
    else if (f == "--window") window = ParseSize(v);
    else if (f == "--inline") inline_max = ParseSize(v);
    else if (f == "--busy-poll-us") busy_us = std::atoll(v.c_str());
    else if (f == "--place-min") place_min = ParseSize(v);
    else if (f == "--stream-min") stream_min = ParseSize(v);
    else if (f == "--piece") piece = ParseSize(v);
    else if (f == "--ring") ring = ParseSize(v);
    else if (f == "--sizes") {
      sizes.clear();
      for (absl::string_view s : absl::StrSplit(v, ',')) sizes.push_back(ParseSize(std::string(s)));
    } else {
      std::fprintf(stderr, "unknown flag %s\n%s", f.c_str(), kUsage);
      return 2;
    }
  }
  if (role == "receiver") return RunReceiver(tls, address_file, inline_max, busy_us, ring, listen);

  const RunInfo info = CollectRunInfo(commit);
  // Against a receiver elsewhere (--connect) there is no local ucx_perftest pair to compare with.
  const bool have_perftest = connect.empty() && access(perftest.c_str(), X_OK) == 0;
  // The settings CreateUcxTransport makes when shared memory is allowed (ucx_transport.cc).
  const bool shm = absl::StrContains(tls, "posix") || absl::StrContains(tls, "sysv") ||
                   absl::StrContains(tls, "sm") || absl::StrContains(tls, "all");
  const std::string same_env = shm ? "UCX_MM_ERROR_HANDLING=y UCX_TCP_PUT_ENABLE=n" : "";

  // The receiver in its own process, as a decode node would be.
  const std::string dir = absl::StrCat("/tmp/strata-transport-bench-", getpid());
  std::filesystem::create_directories(dir);
  address_file = dir + "/address";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  const pid_t child = connect.empty() ? fork() : -1;
  if (child == 0) {
    execl(self.c_str(), self.c_str(), "--role", "receiver", "--tls", tls.c_str(),
          "--address-file", address_file.c_str(), "--inline",
          std::to_string(inline_max).c_str(), "--busy-poll-us", std::to_string(busy_us).c_str(),
          "--ring", std::to_string(ring).c_str(), nullptr);
    _exit(127);
  }
  std::string address = connect;
  for (int i = 0; i < 1000 && address.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::ifstream(address_file) >> address;
  }
  auto stop_child = [&] {
    if (child > 0) {
      kill(child, SIGTERM);
      waitpid(child, nullptr, 0);
    }
    std::filesystem::remove_all(dir);
  };
  if (address.empty()) {
    std::fprintf(stderr, "the receiver process did not start\n");
    stop_child();
    return 1;
  }
  auto t = transport::CreateUcxTransport(
      {.listen_host = "", .tls = tls, .busy_poll = absl::Microseconds(busy_us)});
  if (!t.ok()) {
    std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
    stop_child();
    return 1;
  }
  auto ep = (*t)->Connect(address, absl::Seconds(10));
  if (!ep.ok()) {
    std::fprintf(stderr, "%s\n", ep.status().ToString().c_str());
    stop_child();
    return 1;
  }
  const std::string lanes = (*ep)->Describe();
  std::unique_ptr<BlockSender> sender;

  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  // The blocks live in memory the transport allocated (as a prefill node's block pool would).
  auto region = (*t)->Allocate(max_size, transport::MemoryKind::kHost);
  if (!region.ok()) {
    std::fprintf(stderr, "%s\n", region.status().ToString().c_str());
    stop_child();
    return 1;
  }
  uint8_t* const src = (*region)->data();
  std::mt19937_64 rng(1);
  for (uint64_t i = 0; i + 8 <= max_size; i += 8) {
    const uint64_t x = rng();
    std::memcpy(src + i, &x, 8);
  }

  std::string table;
  auto print = [&](const std::string& s) {
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    table += s;
  };
  print(absl::StrCat("transport_bench  ", info.machine, "  ", info.date, "  commit ", commit,
                     "\nUCX ", transport::UcxVersion(), ", UCX_TLS=", tls,
                     connect.empty() ? "; sender and receiver in two processes on this host\n"
                                     : "; receiver at " + connect + "\n",
                     "receiver verifies blocks <= ",
                     HumanSize(inline_max), " on its transport thread, larger on a verify thread;",
                     " sender window ",
                     window != 0 ? HumanSize(window) : std::string("max(2 blocks, 16M)"),
                     "; direct placement ",
                     place_min == 0 ? std::string("off")
                                    : absl::StrCat("from ", HumanSize(place_min), ", streamed from ",
                                                   stream_min == 0 ? std::string("never")
                                                                   : HumanSize(stream_min),
                                                   ", ring ",
                                                   connect.empty() ? HumanSize(ring)
                                                                   : std::string("the receiver's")),
                     "; blocks not placed go ",
                     piece == 0 ? std::string("whole")
                                : absl::StrCat("in ", HumanSize(piece), " pieces, each checked as it lands"),
                     "; progress threads poll ", busy_us, " us before sleeping",
                     "\nstrata's connection: ", lanes,
                     "\n\n"));
  print(absl::StrCat("perftest: ucp_am_bw / ucp_am_lat with UCX_TLS=", tls, " ", same_env,
                     " -e (peer error handling: the endpoints Strata makes);\n"
                     "perftest plain: the same without -e", shm ? " and those settings" : "",
                     " (UCX's defaults)\n\n"));
  print(absl::StrFormat("%-6s %8s %12s %14s %7s %16s %7s %12s %10s %10s\n", "block", "blocks",
                        "strata MB/s", "perftest MB/s", "ratio", "perftest plain", "ratio",
                        "raw UCX MB/s", "raw ring", "med ratio"));

  std::vector<Row> rows;
  for (uint64_t size : sizes) {
    Row row;
    row.size = size;
    row.blocks = std::clamp<uint64_t>((mib << 20) / size, 64, 200000);
    const uint32_t crc = Crc32c(src, size);
    const Payload payload{.bytes = {src, size}, .region = region->get()};
    row.window = window != 0 ? window : std::max<uint64_t>(2 * size, 16 << 20);
    sender.reset();
    sender = std::move(*BlockSender::Create(
        t->get(), {.max_bytes_in_flight = row.window,
                   .placement_min_bytes = place_min,
                   .stream_min_bytes = stream_min,
                   .piece_bytes = piece}));
    // Warm-up (connection lanes, receiver's buffer pool). Then `reps` rounds, each one run of
    // Strata and one of each ucx_perftest mode back to back: on a small shared machine single
    // runs swing by 2-3x, so the table gives the best round of each (and the JSON the medians).
    for (int i = 0; i < 16; ++i) {
      sender->Send(*ep, "warm", payload, {.crc32c = crc})->Wait().IgnoreError();
    }
    std::vector<double> mine, theirs, plain, raw, raw_ring;
    for (int rep = 0; rep < reps; ++rep) {
      std::vector<std::shared_ptr<Transfer>> ts;
      ts.reserve(row.blocks);
      const auto a = Clock::now();
      for (uint64_t i = 0; i < row.blocks; ++i) {
        ts.push_back(sender->Send(*ep, "b", payload, {.crc32c = crc}));
      }
      bool all_ok = true;
      for (auto& tr : ts) all_ok &= tr->Wait().ok();
      const double s = Seconds(a, Clock::now());
      if (!all_ok) {
        std::fprintf(stderr, "transfers failed at %s\n", HumanSize(size).c_str());
        stop_child();
        return 1;
      }
      mine.push_back(size * row.blocks / s);
      row.placed = sender->stats().placed;
      raw.push_back(RawRound(**ep, payload, row.blocks, row.window));
      raw_ring.push_back(RawRound(**ep, payload, row.blocks, row.window, kRawRingMessage));
      if (have_perftest) {
        PerftestResult p =
            RunPerftest(perftest, tls, same_env, true, "ucp_am_bw", size, row.blocks);
        if (p.ok) theirs.push_back(p.bandwidth);
        if (!p.ok) row.perftest_error = p.error;
        PerftestResult q = RunPerftest(perftest, tls, "", false, "ucp_am_bw", size, row.blocks);
        if (q.ok) plain.push_back(q.bandwidth);
      }
    }
    auto best = [](const std::vector<double>& v) {
      return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
    };
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    row.strata_bw = best(mine);
    row.perftest_bw = best(theirs);
    row.perftest_plain_bw = best(plain);
    row.strata_median = median(mine);
    row.raw_bw = best(raw);
    row.raw_median = median(raw);
    row.raw_ring_bw = best(raw_ring);
    row.perftest_median = median(theirs);
    row.perftest_plain_median = median(plain);
    row.strata_rounds = mine;
    row.perftest_rounds = theirs;
    rows.push_back(row);
    auto mbs = [](double v) { return v > 0 ? absl::StrFormat("%.0f", v / 1e6) : std::string("-"); };
    auto ratio = [](double mine_bw, double theirs_bw) {
      return theirs_bw > 0 ? absl::StrFormat("%.2f", mine_bw / theirs_bw) : std::string("-");
    };
    print(absl::StrFormat("%-6s %8d %12.0f %14s %7s %16s %7s %12.0f %10.0f %10s\n", HumanSize(size),
                          row.blocks, row.strata_bw / 1e6, mbs(row.perftest_bw),
                          ratio(row.strata_bw, row.perftest_bw), mbs(row.perftest_plain_bw),
                          ratio(row.strata_bw, row.perftest_plain_bw), row.raw_bw / 1e6,
                          row.raw_ring_bw / 1e6, ratio(row.strata_median, row.perftest_median)));
  }

  // Latency: one block at a time, send -> verified -> acknowledged; half the round trip is
  // comparable with ucx_perftest's ucp_am_lat (a message and its reply).
  struct Lat {
    uint64_t size;
    double strata_half_rtt_us_p50, strata_half_rtt_us_p99, perftest_us;
  };
  std::vector<Lat> lats;
  print(absl::StrFormat("\n%-6s %22s %22s %18s\n", "block", "strata 1/2 RTT p50 us",
                        "strata 1/2 RTT p99 us", "perftest lat us"));
  sender.reset();
  sender = std::move(*BlockSender::Create(t->get(), {}));
  for (uint64_t size : {uint64_t{8}, uint64_t{4096}}) {
    const uint32_t crc = Crc32c(src, size);
    const Payload payload{.bytes = {src, size}, .region = region->get()};
    std::vector<double> us;
    for (int i = 0; i < 20000; ++i) {
      const auto a = Clock::now();
      sender->Send(*ep, "l", payload, {.crc32c = crc})->Wait().IgnoreError();
      if (i >= 1000) us.push_back(Seconds(a, Clock::now()) * 1e6 / 2);
    }
    std::sort(us.begin(), us.end());
    Lat l{size, us[us.size() / 2], us[us.size() * 99 / 100], 0};
    if (have_perftest) {
      PerftestResult p = RunPerftest(perftest, tls, same_env, true, "ucp_am_lat", size, 20000);
      l.perftest_us = p.ok ? p.latency_us : 0;
    }
    lats.push_back(l);
    print(absl::StrFormat("%-6s %22.2f %22.2f %18s\n", HumanSize(size), l.strata_half_rtt_us_p50,
                          l.strata_half_rtt_us_p99,
                          l.perftest_us > 0 ? absl::StrFormat("%.2f", l.perftest_us) : "-"));
  }
  if (!have_perftest) print(absl::StrCat("\n", perftest, " not found (apt install ucx-utils)\n"));
  const auto stats = sender->stats();
  sender.reset();
  region->reset();
  ep->reset();
  t->reset();
  stop_child();

  std::vector<std::string> jrows;
  for (const Row& r : rows) {
    jrows.push_back(Json()
                        .Num("block_bytes", r.size)
                        .Num("blocks", r.blocks)
                        .Num("window_bytes", r.window)
                        .Num("blocks_placed", r.placed)
                        .Num("strata_bytes_per_s", r.strata_bw)
                        .Num("perftest_bytes_per_s", r.perftest_bw)
                        .Num("ratio", r.perftest_bw > 0 ? r.strata_bw / r.perftest_bw : 0)
                        .Num("perftest_plain_bytes_per_s", r.perftest_plain_bw)
                        .Num("strata_median_bytes_per_s", r.strata_median)
                        .Num("raw_ucx_bytes_per_s", r.raw_bw)
                        .Num("raw_ucx_median_bytes_per_s", r.raw_median)
                        .Num("raw_ucx_ring_bytes_per_s", r.raw_ring_bw)
                        .Num("perftest_median_bytes_per_s", r.perftest_median)
                        .Num("perftest_plain_median_bytes_per_s", r.perftest_plain_median)
                        .Str("perftest_error", r.perftest_error)
                        .Raw("strata_rounds_bytes_per_s", NumArray(r.strata_rounds))
                        .Raw("perftest_rounds_bytes_per_s", NumArray(r.perftest_rounds))
                        .Done());
  }
  std::vector<std::string> jlats;
  for (const Lat& l : lats) {
    jlats.push_back(Json()
                        .Num("block_bytes", l.size)
                        .Num("strata_half_rtt_us_p50", l.strata_half_rtt_us_p50)
                        .Num("strata_half_rtt_us_p99", l.strata_half_rtt_us_p99)
                        .Num("perftest_latency_us", l.perftest_us)
                        .Done());
  }
  const std::string json = ResultJson("transport_bench", info)
                               .Str("ucx_version", transport::UcxVersion())
                               .Str("ucx_tls", tls)
                               .Num("inline_max_bytes", inline_max)
                               .Num("placement_min_bytes", place_min)
                               .Num("stream_min_bytes", stream_min)
                               .Num("piece_bytes", piece)
                               .Num("ring_bytes", connect.empty() ? ring : 0)  // 0: remote
                               .Num("busy_poll_us", busy_us)
                               .Str("perftest_env", same_env + " -e")
                               .Str("connection", lanes)
                               .Num("blocks_sent", stats.sent)
                               .Raw("throughput", JsonArray(jrows))
                               .Raw("latency", JsonArray(jlats))
                               .Done();
  std::string tag = tls;
  std::replace(tag.begin(), tag.end(), ',', '+');
  if (place_min == 0) tag += "-noplace";
  const std::string base = ResultPath(out_dir, "transport_bench", info, tag);
  if (!WriteResultFile(base + ".json", json + "\n") || !WriteResultFile(base + ".txt", table)) {
    return 1;
  }
  std::printf("\nwrote %s.{json,txt}\n", base.c_str());
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
