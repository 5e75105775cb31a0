// store_bench: BlockStore Put/Get throughput and p50/p99 latency per tier (RAM, disk through
// RocksDB) at 256 KiB and 2 MiB blocks with 1 and 8 client threads, against a raw memcpy and a
// raw sequential file write/read of the same sizes measured in the same run (the ratios are the
// result; absolute numbers depend on the machine).
// Prints a table and writes JSON to --out (default bench/results). Flags: kUsage below (--help).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "common/block_writer.h"
#include "common/block_reader.h"
#include "kvstore/block_store.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

// A valid block of about `bytes` bytes (raw fp16-like payload in one codes section).
AlignedBuffer MakeBlock(size_t bytes, uint32_t chunk) {
  BlockHeader h;
  h.codec = CodecId::kFp16;
  h.codec_spec = "fp16";
  h.layer = 0;
  h.chunk_index = chunk;
  h.kv_heads = 8;
  h.head_dim = 128;
  h.token_count = static_cast<uint32_t>(std::max<size_t>(1, bytes / (2 * 2 * 8 * 128)));
  h.model_fingerprint = 77;
  const uint32_t n = h.token_count * 8 * 128;
  std::vector<SectionDesc> s = {{SectionKind::kCodes, Tensor::kKey, ElemType::kFloat16, n, 64},
                                {SectionKind::kCodes, Tensor::kValue, ElemType::kFloat16, n, 64}};
  BlockBuilder b = *BlockBuilder::Create(h, s);
  std::mt19937 rng(chunk);
  for (int i = 0; i < 2; ++i) {
    auto sec = b.section(i);
    for (size_t j = 0; j < sec.size(); j += 4) {
      const uint32_t r = rng();
      std::memcpy(sec.data() + j, &r, std::min<size_t>(4, sec.size() - j));
    }
  }
  return std::move(b).Finish();
}

BlockHash Key(uint32_t i) {
  BlockHash k{};
  std::memcpy(k.data(), &i, 4);
  k[31] = 1;
  return k;
}

struct Stat {
  double gbps = 0, p50_us = 0, p99_us = 0;
};

Stat Summarize(std::vector<double>& lat_s, size_t bytes_total, double wall_s) {
  std::sort(lat_s.begin(), lat_s.end());
  Stat s;
  s.gbps = bytes_total / wall_s / 1e9;
  s.p50_us = lat_s[lat_s.size() / 2] * 1e6;
  s.p99_us = lat_s[std::min(lat_s.size() - 1, lat_s.size() * 99 / 100)] * 1e6;
  return s;
}

// Runs op(i) for i in [0, n) on `threads` threads; latency per op.
template <typename Op>
Stat Run(int threads, uint32_t n, size_t bytes, Op&& op) {
  std::vector<std::vector<double>> lat(threads);
  std::atomic<uint32_t> next{0};
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (uint32_t i = next++; i < n; i = next++) {
        const auto a = Clock::now();
        op(i);
        lat[t].push_back(std::chrono::duration<double>(Clock::now() - a).count());
      }
    });
  }
  for (auto& t : ts) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> all;
  for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  return Summarize(all, size_t{n} * bytes, wall);
}

constexpr char kUsage[] =
    "usage: store_bench [--dir DIR] [--mib N] [--commit SHA]\n"
    "                   [--out DIR (default bench/results)]\n";

int Main(int argc, char** argv) {
  std::string dir = "/tmp/strata-store-bench", commit = "unknown", out_dir = "bench/results";
  uint32_t mib = 512;  // data per measurement
  int exit_code = 0;
  const auto flags = FlagPairs(argc, argv, kUsage, &exit_code);
  if (!flags) return exit_code;
  for (const auto& [f, v] : *flags) {
    if (f == "--dir") dir = v;
    else if (f == "--commit") commit = v;
    else if (f == "--out") out_dir = v;
    else if (f == "--mib" && absl::SimpleAtoi(v, &mib)) continue;
    else {
      std::fprintf(stderr, "bad flag %s %s\n%s", f.c_str(), v.c_str(), kUsage);
      return 2;
    }
  }
  const RunInfo info = CollectRunInfo(commit);
  std::printf("store_bench  %s  %s  commit %s; %u MiB per measurement, disk tier in %s\n",
              info.machine.c_str(), info.date.c_str(), commit.c_str(), mib, dir.c_str());
  std::printf("%-28s %6s %7s | %9s %9s %9s | %8s\n", "operation", "block", "threads", "GB/s",
              "p50 us", "p99 us", "vs raw");
  std::vector<std::string> rows;
  auto row = [&](const std::string& what, size_t block, int threads, const Stat& s, double raw) {
    std::printf("%-28s %5zuK %7d | %9.2f %9.1f %9.1f | %7.2fx\n", what.c_str(), block >> 10,
                threads, s.gbps, s.p50_us, s.p99_us, raw > 0 ? s.gbps / raw : 0.0);
    rows.push_back(Json()
                       .Str("operation", what)
                       .Num("block_bytes", block)
                       .Num("threads", threads)
                       .Num("gb_per_s", s.gbps)
                       .Num("p50_us", s.p50_us)
                       .Num("p99_us", s.p99_us)
                       .Num("ratio_to_raw", raw > 0 ? s.gbps / raw : 0.0)
                       .Done());
  };
  for (size_t block_target : {size_t{256} << 10, size_t{2} << 20}) {
    const uint32_t n = static_cast<uint32_t>((size_t{mib} << 20) / block_target);
    std::vector<AlignedBuffer> blocks;
    // Each name is a chain of its own (Put without a parent): every block is a first chunk.
    for (uint32_t i = 0; i < std::min<uint32_t>(n, 64); ++i) blocks.push_back(MakeBlock(block_target, 0));
    const size_t block = blocks[0].size();
    auto src = [&](uint32_t i) -> const AlignedBuffer& { return blocks[i % blocks.size()]; };
    std::vector<BlockName> names(n);
    for (uint32_t i = 0; i < n; ++i) {
      const BlockHeader h = BlockView::Parse(src(i).span())->header();
      names[i] = BlockName{h.model_fingerprint, h.codec_fingerprint, 0, Key(i), 0};
    }
    for (int threads : {1, 8}) {
      // Raw references: memcpy into fresh buffers; sequential file write (+ fdatasync at the
      // end) and read back of the same bytes.
      std::vector<AlignedBuffer> dst(64);
      for (auto& d : dst) d = AlignedBuffer(block);
      const Stat copy = Run(threads, n, block, [&](uint32_t i) {
        std::memcpy(dst[i % 64].data(), src(i).data(), block);
      });
      row("raw memcpy", block, threads, copy, 0);
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir);
      const std::string raw_file = dir + "/raw";
      const int fd = open(raw_file.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0644);
      const Stat fw = Run(threads, n, block, [&](uint32_t i) {
        if (pwrite(fd, src(i).data(), block, off_t{i} * block) != static_cast<ssize_t>(block)) std::abort();
      });
      fdatasync(fd);
      row("raw file write", block, threads, fw, 0);
      const Stat fr = Run(threads, n, block, [&](uint32_t i) {
        if (pread(fd, dst[i % 64].data(), block, off_t{i} * block) != static_cast<ssize_t>(block)) std::abort();
      });
      row("raw file read (page cache)", block, threads, fr, 0);
      close(fd);
      std::filesystem::remove(raw_file);
      // RAM tier: everything fits.
      {
        // Room for the data twice over, and a pool that can keep all of it idle.
        auto s = *kvstore::BlockStore::Open({.ram_bytes = size_t{n} * block * 4});
        const Stat put = Run(threads, n, block, [&](uint32_t i) {
          if (!s->Put(names[i], nullptr, src(i).span()).ok()) std::abort();
        });
        row("store put (RAM, cold)", block, threads, put, copy.gbps);
        // Steady state: the blocks are deleted and put again, into recycled buffers.
        for (uint32_t i = 0; i < n; ++i) s->Delete(names[i]);
        const Stat warm = Run(threads, n, block, [&](uint32_t i) {
          if (!s->Put(names[i], nullptr, src(i).span()).ok()) std::abort();
        });
        row("store put (RAM, warm pool)", block, threads, warm, copy.gbps);
        const Stat get = Run(threads, n, block, [&](uint32_t i) {
          auto l = s->Get(names[i]);
          if (!l.ok()) std::abort();
          std::memcpy(dst[i % 64].data(), l->bytes().data(), block);  // the reader consumes it
        });
        row("store get (RAM) + copy", block, threads, get, copy.gbps);
      }
      // Disk tier: a RAM of one block, durable puts (write-through), gets from disk.
      {
        std::filesystem::remove_all(dir);
        auto s = *kvstore::BlockStore::Open({.ram_bytes = block, .disk_path = dir,
                                             .disk_bytes = size_t{n} * block * 2});
        const Stat put = Run(threads, n, block, [&](uint32_t i) {
          if (!s->Put(names[i], nullptr, src(i).span()).ok()) std::abort();
        });
        row("store put (disk, durable)", block, threads, put, fw.gbps);
        const Stat get = Run(threads, n, block, [&](uint32_t i) {
          auto l = s->Get(names[i]);
          if (!l.ok()) std::abort();
        });
        row("store get (disk, verified)", block, threads, get, fr.gbps);
      }
      std::filesystem::remove_all(dir);
    }
  }
  const std::string path = ResultPath(out_dir, "store_bench", info) + ".json";
  if (!WriteResultFile(path, ResultJson("store_bench", info).Raw("rows", JsonArray(rows)).Done() +
                                 "\n")) {
    return 1;
  }
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
