// nccl_bench: throughput of the NCCL transport (transport/nccl/) moving device blocks, against a
// plain CUDA copy of the same blocks on the same GPUs as the ceiling. With one GPU the transport
// sends to itself (a one-rank communicator); with two or more, GPU 0 sends to GPU 1 (ceiling:
// cudaMemcpyPeerAsync). Headers travel over the in-process host transport.
//
//   nccl_bench [--sizes 64K,1M,16M,64M] [--mib 1024] [--window-mib 256] [--reps 3]
//              [--out bench/results] [--commit SHA]
//
// Writes OUT/nccl_bench-DATE-COMMIT.{json,md}. Needs a GPU: without one it says why and exits 1.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/byte_size.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/nccl/nccl_transport.h"

namespace strata {
namespace {

using transport::Destination;
using transport::IncomingMessage;
using transport::MemoryKind;
using transport::MemoryRegion;
using transport::Payload;
using transport::Transport;

constexpr char kUsage[] =
    "nccl_bench [--sizes 64K,1M,16M,64M] [--mib 1024] [--window-mib 256] [--reps 3]\n"
    "           [--out bench/results] [--commit SHA]\n";

// Counts completions; Wait returns the first failure, or OK once `n` have come.
class Counter {
 public:
  void Done(const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    if (!s.ok() && first_error_.ok()) first_error_ = s;
    cv_.notify_all();
  }
  // Blocks while more than `limit` of `issued` are outstanding.
  void WaitBelow(uint64_t issued, uint64_t limit) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return issued - done_ <= limit || !first_error_.ok(); });
  }
  absl::Status WaitAll(uint64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= n || !first_error_.ok(); });
    return first_error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t done_ = 0;
  absl::Status first_error_;
};

struct Row {
  size_t size = 0;
  double nccl_gbs = 0, copy_gbs = 0;
};

int Main(int argc, char** argv) {
  int exit_code = 0;
  auto flags = bench::FlagPairs(argc, argv, kUsage, &exit_code);
  if (!flags) return exit_code;
  std::vector<size_t> sizes = {64 << 10, 1 << 20, 16 << 20, 64 << 20};
  uint64_t mib = 1024, window_mib = 256;
  int reps = 3;
  std::string out = "bench/results", commit = "unknown";
  for (const auto& [k, v] : *flags) {
    bool ok = true;
    if (k == "--sizes") {
      sizes.clear();
      for (absl::string_view s : absl::StrSplit(v, ',')) {
        uint64_t n = 0;
        ok = ok && ParseByteSize(std::string(s), &n) && n > 0;
        sizes.push_back(n);
      }
    } else if (k == "--mib") {
      ok = absl::SimpleAtoi(v, &mib) && mib > 0;
    } else if (k == "--window-mib") {
      ok = absl::SimpleAtoi(v, &window_mib) && window_mib > 0;
    } else if (k == "--reps") {
      ok = absl::SimpleAtoi(v, &reps) && reps > 0;
    } else if (k == "--out") {
      out = v;
    } else if (k == "--commit") {
      commit = v;
    } else {
      ok = false;
    }
    if (!ok) {
      std::cerr << "nccl_bench: bad flag " << k << " " << v << "\n" << kUsage;
      return 2;
    }
  }

  int gpus = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&gpus); e != cudaSuccess || gpus == 0) {
    std::cerr << "nccl_bench: needs a GPU: "
              << (e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device") << "\n";
    return 1;
  }
  const bool pair = gpus >= 2;
  auto make = [](int device) {
    auto host = transport::CreateInprocTransport({});
    if (!host.ok()) return absl::StatusOr<std::unique_ptr<Transport>>(host.status());
    return transport::CreateNcclTransport(
        {.host = std::shared_ptr<Transport>(*std::move(host)), .device = device});
  };
  auto a = make(0);
  if (!a.ok()) {
    std::cerr << "nccl_bench: " << a.status() << "\n";
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Transport>> b_owned = absl::UnknownError("unused");
  Transport* b = a->get();
  if (pair) {
    b_owned = make(1);
    if (!b_owned.ok()) {
      std::cerr << "nccl_bench: " << b_owned.status() << "\n";
      return 1;
    }
    b = b_owned->get();
  }
  auto ep = (*a)->Connect(b->address(), absl::Seconds(60));
  if (!ep.ok()) {
    std::cerr << "nccl_bench: Connect: " << ep.status() << "\n";
    return 1;
  }
  const std::string path_desc =
      pair ? "GPU 0 -> GPU 1 (two transports)" : "GPU 0 -> itself (one-rank communicator)";
  std::cout << "nccl_bench: NCCL " << transport::NcclVersion() << ", " << gpus << " GPU(s), "
            << path_desc << "; " << (*ep)->Describe() << "\n";

  std::vector<Row> rows;
  for (size_t size : sizes) {
    const uint64_t count = std::max<uint64_t>(8, (mib << 20) / size);
    const uint64_t slots = std::clamp<uint64_t>((window_mib << 20) / size, 1, count);
    auto src = (*a)->Allocate(size, MemoryKind::kDevice);
    auto dst = b->Allocate(size * slots, MemoryKind::kDevice);
    if (!src.ok() || !dst.ok()) {
      std::cerr << "nccl_bench: Allocate: " << (src.ok() ? dst.status() : src.status()) << "\n";
      return 1;
    }
    MemoryRegion* d = dst->get();
    std::atomic<Counter*> received{nullptr};  // this run's
    b->SetHandler(1, [&](IncomingMessage& m) {
      uint64_t i = 0;
      std::memcpy(&i, m.header().data(), sizeof(i));
      Counter* c = received.load();
      m.Accept(Destination{{d->data() + (i % slots) * size, size}, d},
               [c](absl::Status s) { c->Done(s); });
    });
    absl::Status failed;
    const double nccl_s = bench::MedianSeconds(reps, [&] {
      Counter sent, got;
      received.store(&got);
      for (uint64_t i = 0; i < count; ++i) {
        sent.WaitBelow(i, slots - 1);
        const uint8_t* h = reinterpret_cast<const uint8_t*>(&i);
        (*ep)->Send(1, {h, sizeof(i)}, Payload{{(*src)->data(), size}, src->get()},
                    absl::Seconds(60), [&sent](absl::Status s) { sent.Done(s); });
      }
      absl::Status s = sent.WaitAll(count);
      if (s.ok()) s = got.WaitAll(count);
      if (!s.ok() && failed.ok()) failed = s;
    });
    if (!failed.ok()) {
      std::cerr << "nccl_bench: transfer failed at " << size << " bytes: " << failed << "\n";
      return 1;
    }
    // The ceiling: the same blocks copied by CUDA on the same GPUs, on one stream.
    cudaStream_t stream = nullptr;
    (void)cudaSetDevice(0);
    (void)cudaStreamCreate(&stream);
    const double copy_s = bench::MedianSeconds(reps, [&] {
      for (uint64_t i = 0; i < count; ++i) {
        uint8_t* to = d->data() + (i % slots) * size;
        if (pair) {
          (void)cudaMemcpyPeerAsync(to, 1, (*src)->data(), 0, size, stream);
        } else {
          (void)cudaMemcpyAsync(to, (*src)->data(), size, cudaMemcpyDeviceToDevice, stream);
        }
      }
      (void)cudaStreamSynchronize(stream);
    });
    (void)cudaStreamDestroy(stream);
    Row r{.size = size,
          .nccl_gbs = static_cast<double>(count * size) / nccl_s / 1e9,
          .copy_gbs = static_cast<double>(count * size) / copy_s / 1e9};
    std::printf("%10zu bytes  nccl %8.2f GB/s  cuda copy %8.2f GB/s  ratio %.2f\n", size,
                r.nccl_gbs, r.copy_gbs, r.nccl_gbs / r.copy_gbs);
    rows.push_back(r);
    b->SetHandler(1, nullptr);
  }

  const bench::RunInfo info = bench::CollectRunInfo(commit);
  std::string md = absl::StrFormat(
      "# nccl_bench\n\n%s, %s, commit %s. NCCL %s, %s. Median of %d runs; %d MiB per size, "
      "up to %d MiB in flight.\n\n| block | NCCL transport GB/s | CUDA copy GB/s | ratio |\n"
      "| ---: | ---: | ---: | ---: |\n",
      info.machine, info.date, info.commit, transport::NcclVersion(), path_desc, reps, mib,
      window_mib);
  std::vector<std::string> items;
  for (const Row& r : rows) {
    absl::StrAppendFormat(&md, "| %zu | %.2f | %.2f | %.2f |\n", r.size, r.nccl_gbs, r.copy_gbs,
                          r.nccl_gbs / r.copy_gbs);
    items.push_back(bench::Json()
                        .Num("block_bytes", static_cast<double>(r.size))
                        .Num("nccl_gbs", r.nccl_gbs)
                        .Num("cuda_copy_gbs", r.copy_gbs)
                        .Done());
  }
  const std::string json = bench::ResultJson("nccl_bench", info)
                               .Str("nccl", transport::NcclVersion())
                               .Str("path", path_desc)
                               .Num("gpus", gpus)
                               .Raw("rows", bench::JsonArray(items))
                               .Done();
  const std::string base = bench::ResultPath(out, "nccl_bench", info);
  if (!bench::WriteResultFile(base + ".json", json + "\n") ||
      !bench::WriteResultFile(base + ".md", md)) {
    return 1;
  }
  std::cout << "wrote " << base << ".{json,md}\n";
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::Main(argc, argv); }
