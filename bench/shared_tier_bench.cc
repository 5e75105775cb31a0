// The shared tier (kvstore/shared_tier.h) on a Redis Cluster this program starts on loopback (3
// masters, Debian's redis-server): Put and Get throughput and latency per block size, against
// redis-benchmark's SET and GET at the same value size on the same cluster in the same run (the
// anchor: what Redis itself sustains here). Blocks are real fp16 blocks (checksums verified on
// every Get, as the store's promotion does); each client thread pipelines a batch of distinct
// blocks per call, as a Lookup's promotion does.
//
//   shared_tier_bench [--out DIR] [--commit C] [--threads N] [--batch B] [--seconds S] [--tls 1]
//                     [--tokens 16,64,256]
// With --tls the cluster serves TLS only (client certificates required), the tier and
// redis-benchmark both speak it. Prints a table; with --out writes
// DIR/shared_tier_bench[-tls]-DATE-COMMIT.{txt,json}.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "common/block_reader.h"
#include "kernels/codec.h"
#include "kvstore/shared_tier.h"
#include "kvstore/testing/redis_cluster_process.h"

namespace {

using strata::AlignedBuffer;
using strata::BlockName;
using strata::SharedBytes;
using strata::kvstore::SharedTier;

constexpr char kUsage[] =
    "usage: shared_tier_bench [--out DIR] [--commit C] [--threads N] [--batch B] [--seconds S] "
    "[--tls 1] [--tokens 16,64,256]\n"
    "  --tokens: the block sizes, in tokens of 4 KiB (fp16, 8 KV heads of 128)\n";

// A real fp16 block of `tokens` tokens, 8 KV heads of 128: 4 KiB per token.
AlignedBuffer Block(uint32_t tokens, uint32_t chunk, uint32_t seed) {
  std::vector<float> k(size_t{tokens} * 8 * 128), v(k.size());
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  for (float& x : k) x = n(rng);
  for (float& x : v) x = n(rng);
  auto codec = *strata::kernels::Codec::Create("fp16");
  return *codec->Encode({k.data(), v.data(), strata::SourceDType::kFloat32, tokens, 8, 128},
                        {.layer = 0, .chunk_index = chunk, .model_fingerprint = 5});
}

struct Result {
  double ops_per_s = 0, mb_per_s = 0, p50_ms = 0, p99_ms = 0;
  uint64_t errors = 0;
  // CPU seconds per block (per request for the anchor): the client's (this process, or
  // redis-benchmark), and the Redis servers' together. Where the machine's cores are all busy,
  // their sum bounds the rate: cores / (client + servers).
  double client_cpu_us = 0, server_cpu_us = 0;
};

double Seconds(const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; }

// CPU seconds used so far by this process (`who` RUSAGE_SELF) or its waited-for children.
double RusageSeconds(int who) {
  rusage u{};
  getrusage(who, &u);
  return Seconds(u.ru_utime) + Seconds(u.ru_stime);
}

// CPU seconds used so far by the cluster's redis-server processes together.
double ServersSeconds(const strata::kvstore::testing::RedisClusterProcess& cluster) {
  double total = 0;
  for (const auto& n : cluster.nodes()) {
    std::ifstream f(absl::StrCat("/proc/", n.pid, "/stat"));
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t close = stat.rfind(')');  // fields after the command name; utime, stime: 14, 15
    if (close == std::string::npos) continue;
    std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
    unsigned long long ut = 0, st = 0;
    if (fields.size() > 12 && absl::SimpleAtoi(fields[11], &ut) &&
        absl::SimpleAtoi(fields[12], &st)) {
      total += static_cast<double>(ut + st) / sysconf(_SC_CLK_TCK);
    }
  }
  return total;
}

// `threads` threads, each calling `call(thread, i)` (one pipelined batch) for `seconds`.
template <typename F>
Result Drive(const strata::kvstore::testing::RedisClusterProcess& cluster, int threads, int batch,
             double seconds, size_t block_bytes, F call) {
  std::atomic<uint64_t> calls{0}, errors{0};
  std::vector<std::vector<double>> lat(threads);
  std::vector<std::thread> ts;
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  const absl::Time start = absl::Now();
  const double client0 = RusageSeconds(RUSAGE_SELF), servers0 = ServersSeconds(cluster);
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (uint64_t i = 0; absl::Now() < end; ++i) {
        const absl::Time a = absl::Now();
        errors += call(t, i);
        lat[t].push_back(absl::ToDoubleMilliseconds(absl::Now() - a));
        ++calls;
      }
    });
  }
  for (std::thread& th : ts) th.join();
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  const double blocks = static_cast<double>(calls.load()) * batch;
  std::vector<double> all;
  for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  Result r;
  r.ops_per_s = calls.load() * batch / elapsed;
  r.mb_per_s = r.ops_per_s * block_bytes / 1e6;
  r.p50_ms = all.empty() ? 0 : all[all.size() / 2];
  r.p99_ms = all.empty() ? 0 : all[all.size() * 99 / 100];
  r.errors = errors.load();
  if (blocks > 0) {
    r.client_cpu_us = (RusageSeconds(RUSAGE_SELF) - client0) / blocks * 1e6;
    r.server_cpu_us = (ServersSeconds(cluster) - servers0) / blocks * 1e6;
  }
  return r;
}

// redis-benchmark's requests per second for `test` ("set" or "get") of `bytes`-byte values on the
// cluster, over 8 GiB of values (seconds at these rates: a run of a few hundred ms, as 2 GiB / 4
// gave, swung by 2x from run to run), with its CPU and the servers' per request. `tls`:
// redis-benchmark's TLS arguments ("" for plain TCP).
Result RedisBenchmark(const strata::kvstore::testing::RedisClusterProcess& cluster,
                      const std::string& test, size_t bytes, int clients, int pipeline,
                      const std::string& tls) {
  const std::string out = "/tmp/shared_tier_bench_rb.csv";
  const size_t n = std::max<size_t>(2000, (size_t{8} << 30) / bytes);
  const std::string cmd =
      absl::StrCat("redis-benchmark --cluster ", tls, " -p ", cluster.nodes()[0].port, " -d ",
                   bytes, " -t ", test, " -r 512 -n ", n, " -c ", clients, " -P ", pipeline,
                   " --csv -q > ", out, " 2>/dev/null");
  Result r;
  const double client0 = RusageSeconds(RUSAGE_CHILDREN), servers0 = ServersSeconds(cluster);
  if (std::system(cmd.c_str()) != 0) return r;
  r.client_cpu_us = (RusageSeconds(RUSAGE_CHILDREN) - client0) / n * 1e6;
  r.server_cpu_us = (ServersSeconds(cluster) - servers0) / n * 1e6;
  FILE* f = std::fopen(out.c_str(), "r");
  if (f == nullptr) return r;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    std::vector<std::string> cols = absl::StrSplit(line, ',');
    if (cols.size() < 2) continue;
    std::string rps = cols[1];
    rps.erase(std::remove(rps.begin(), rps.end(), '"'), rps.end());
    double v = 0;
    if (absl::SimpleAtod(rps, &v) && v > 0) r.ops_per_s = v;
  }
  std::fclose(f);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  auto flags = strata::bench::FlagPairs(argc, argv, kUsage, &exit_code);
  if (!flags) return exit_code;
  std::string out_dir, commit = "unknown";
  int threads = 8, batch = 8;
  std::vector<uint32_t> block_tokens = {16, 64, 256};  // blocks of 64 KiB, 256 KiB and 1 MiB
  double seconds = 3;
  bool tls = false;
  for (const auto& [k, v] : *flags) {
    if (k == "--tls") {
      tls = v == "1" || v == "true";
    } else if (k == "--out") {
      out_dir = v;
    } else if (k == "--commit") {
      commit = v;
    } else if (k == "--threads") {
      threads = std::max(1, std::atoi(v.c_str()));
    } else if (k == "--batch") {
      batch = std::max(1, std::atoi(v.c_str()));
    } else if (k == "--tokens") {  // blocks of 4 KiB per token
      block_tokens.clear();
      for (absl::string_view t : absl::StrSplit(v, ',')) {
        uint32_t n = 0;
        if (!absl::SimpleAtoi(t, &n) || n == 0 || n > 4096) {
          std::fprintf(stderr, "shared_tier_bench: --tokens takes numbers 1..4096, not %s\n%s",
                       v.c_str(), kUsage);
          return 2;
        }
        block_tokens.push_back(n);
      }
    } else if (k == "--seconds") {
      seconds = std::max(0.5, std::atof(v.c_str()));
    } else {
      std::fprintf(stderr, "shared_tier_bench: unknown flag %s\n%s", k.c_str(), kUsage);
      return 2;
    }
  }
  if (!strata::kvstore::testing::RedisClusterProcess::Installed()) {
    std::fprintf(stderr,
                 "shared_tier_bench: no redis-server here (scripts/setup.sh installs it)\n");
    return 1;
  }
  strata::kvstore::testing::RedisClusterProcess cluster(3, 0, "", tls);
  std::string why;
  if (!cluster.Start(&why)) {
    std::fprintf(stderr, "shared_tier_bench: %s\n", why.c_str());
    return 1;
  }
  strata::kvstore::RedisTlsOptions tls_options;
  std::string tls_args;
  if (tls) {
    tls_options = {.enabled = true,
                   .ca_file = cluster.ca_file(),
                   .cert_file = cluster.client_cert_file(),
                   .key_file = cluster.client_key_file()};
    tls_args = absl::StrCat("--tls --cacert ", cluster.ca_file(), " --cert ",
                            cluster.client_cert_file(), " --key ", cluster.client_key_file());
  }
  absl::StatusOr<std::unique_ptr<SharedTier>> tier = SharedTier::Connect(
      {.redis = {.seeds = {cluster.seed()}, .max_idle_per_node = 64, .tls = tls_options}});
  if (!tier.ok()) {
    std::fprintf(stderr, "shared_tier_bench: %s\n", tier.status().ToString().c_str());
    return 1;
  }
  const strata::bench::RunInfo info = strata::bench::CollectRunInfo(commit);
  std::ostringstream txt;
  txt << "shared_tier_bench: " << info.machine << ", " << info.date << ", commit " << info.commit
      << "\nRedis Cluster of 3 masters on loopback (redis-server from Debian"
      << (tls ? ", TLS only: TLS 1.3, P-256 certificates, client certificates required" : "")
      << "); " << threads << " client threads, " << batch
      << " blocks pipelined per call; redis-benchmark --cluster with as many clients and the same "
         "pipeline depth, one test (SET, GET) at a time\n"
         "cpu us: CPU microseconds per block, the client's (this process; redis-benchmark for the "
         "anchor) + the Redis servers' together\n\n";
  char line[320];
  std::snprintf(line, sizeof(line), "%-10s %-4s %12s %10s %9s %9s %14s %8s %17s %17s\n", "block",
                "op", "blocks/s", "MB/s", "p50 ms", "p99 ms", "redis-bench/s", "ratio",
                "cpu us cl+redis", "anchor cl+redis");
  txt << line;
  std::vector<std::string> rows;
  for (uint32_t tokens : block_tokens) {
    // Distinct blocks per thread and slot: chunk index fixed, prefix keys distinct.
    const AlignedBuffer proto = Block(tokens, 1, tokens);
    const size_t bytes = proto.size();
    const int keys_per_thread = 64;
    std::vector<std::vector<SharedTier::Item>> items(threads);
    for (int t = 0; t < threads; ++t) {
      for (int i = 0; i < keys_per_thread; ++i) {
        BlockName n;
        n.model_fingerprint = 5;
        n.codec_fingerprint = strata::BlockView::Parse(proto.span())->header().codec_fingerprint;
        n.key[0] = static_cast<uint8_t>(t);
        n.key[1] = static_cast<uint8_t>(i);
        n.key[2] = static_cast<uint8_t>(tokens);
        AlignedBuffer copy(bytes);
        std::memcpy(copy.data(), proto.data(), bytes);
        items[t].push_back({n, 1, SharedBytes::FromBuffer(std::move(copy))});
      }
    }
    const Result put = Drive(cluster, threads, batch, seconds, bytes, [&](int t, uint64_t i) {
      std::vector<SharedTier::Item> b;
      for (int j = 0; j < batch; ++j) b.push_back(items[t][(i * batch + j) % keys_per_thread]);
      uint64_t e = 0;
      for (const absl::Status& s : (*tier)->Put(b)) e += !s.ok();
      return e;
    });
    const Result get = Drive(cluster, threads, batch, seconds, bytes, [&](int t, uint64_t i) {
      std::vector<SharedTier::Key> b;
      for (int j = 0; j < batch; ++j) {
        const SharedTier::Item& it = items[t][(i * batch + j) % keys_per_thread];
        b.push_back({it.name, 1});
      }
      uint64_t e = 0;
      for (const auto& r : (*tier)->Get(b)) e += !r.ok();
      return e;
    });
    const Result rb_set = RedisBenchmark(cluster, "set", bytes, threads, batch, tls_args);
    const Result rb_get = RedisBenchmark(cluster, "get", bytes, threads, batch, tls_args);
    for (const auto& [op, r, rb] :
         {std::tuple{"put", put, rb_set}, std::tuple{"get", get, rb_get}}) {
      const double anchor = rb.ops_per_s;
      std::snprintf(
          line, sizeof(line),
          "%-10s %-4s %12.0f %10.1f %9.2f %9.2f %14.0f %7.2fx %8.0f+%-8.0f %8.0f+%-8.0f\n",
          absl::StrCat(bytes / 1024, " KiB").c_str(), op, r.ops_per_s, r.mb_per_s, r.p50_ms,
          r.p99_ms, anchor, anchor > 0 ? r.ops_per_s / anchor : 0.0, r.client_cpu_us,
          r.server_cpu_us, rb.client_cpu_us, rb.server_cpu_us);
      txt << line;
      rows.push_back(strata::bench::Json()
                         .Num("block_bytes", static_cast<double>(bytes))
                         .Str("op", op)
                         .Num("blocks_per_s", r.ops_per_s)
                         .Num("mb_per_s", r.mb_per_s)
                         .Num("p50_ms", r.p50_ms)
                         .Num("p99_ms", r.p99_ms)
                         .Num("errors", static_cast<double>(r.errors))
                         .Num("redis_benchmark_per_s", anchor)
                         .Num("client_cpu_us", r.client_cpu_us)
                         .Num("redis_cpu_us", r.server_cpu_us)
                         .Num("redis_benchmark_cpu_us", rb.client_cpu_us)
                         .Num("redis_benchmark_redis_cpu_us", rb.server_cpu_us)
                         .Done());
    }
  }
  const strata::kvstore::SharedTierStats st = (*tier)->Stats();
  txt << "\nshared tier: " << st.hits << " hits, " << st.misses << " misses, " << st.damaged
      << " damaged, " << st.put_errors << " put errors, " << st.get_errors << " get errors; "
      << st.redis.connects << " connections opened, " << st.redis.stale << " stale, "
      << st.redis.io_errors << " lost or timed out, " << st.redis.retries << " retries\n";
  std::fputs(txt.str().c_str(), stdout);
  if (!out_dir.empty()) {
    // Runs at other thread counts or batches keep files of their own.
    const std::string tag =
        threads == 8 && batch == 8 ? "" : absl::StrCat("threads", threads, "-batch", batch);
    const std::string path = strata::bench::ResultPath(
        out_dir, tls ? "shared_tier_bench-tls" : "shared_tier_bench", info, tag);
    strata::bench::WriteResultFile(path + ".txt", txt.str());
    strata::bench::WriteResultFile(path + ".json",
                                   strata::bench::ResultJson("shared_tier_bench", info)
                                       .Num("threads", threads)
                                       .Num("batch", batch)
                                       .Num("tls", tls ? 1 : 0)
                                       .Raw("rows", strata::bench::JsonArray(rows))
                                       .Done());
  }
  return 0;
}
