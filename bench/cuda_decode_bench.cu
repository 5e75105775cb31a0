// GPU decode attention over paged KV (kernels/cuda/paged_decode.h): our fp16 kernel, the 4-bit
// and 2-bit affine (KIVI-style) kernels, the general kernel (every other codec's pages, read
// through a descriptor: over KIVI k4v4 pages beside the affine kernel, and over int8, GEAR, SKVQ
// and CQ pages) and the codebook kernel (CQ pages: c4:b8, c8:b8, c2:b5), against the
// device-to-device copy bandwidth measured in the same run. Shapes of an 8B model's attention: head
// dim 128, 32 query heads over 8 KV heads; batch 1 / 16 / 64; context 4k / 32k / 128k (128k up to
// batch 16). Each time is the median of runs timed with CUDA events, L2 flushed before each (a 256
// MiB memset outside the timed region); the bytes are those the kernel must read (every section of
// every page of every sequence), so the bandwidth is an effective one. Pages are blocks in the
// Strata block format, read in place (block_pages.h), of 64 and 256 tokens (256: the default
// chunk). Data is random (finite fp16 values, random codes), never zeros.
//
//   cuda_decode_bench [--out DIR] [--runs N] [--quick] [--splits N] [--page_tokens N[,N...]]
//                     [--kernels NAME[,NAME...]]
// (--quick: batch 16 at 32k only; --splits: force the split count instead of ChooseSplits';
// --kernels: only these rows, by the table's kernel names, e.g. "affine k4v4 g32": a profiler
// then sees only their launches)
// Prints a table; with --out, writes DIR/cuda_decode_bench-<device>-<date>-<commit>.{txt,json}
// (commit from $STRATA_COMMIT). Exits 1 without a GPU, saying so.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/gpu_run_info.h"
#include "kernels/codec.h"
#include "kernels/codec_spec.h"
#include "kernels/cuda/block_pages.h"
#include "kernels/cuda/compress.h"
#include "kernels/cuda/paged_decode.h"
#include "kernels/synthetic_kv.h"

namespace {

using strata::kernels::cuda::PagedDecodeArgs;
using strata::kernels::cuda::PagedKernel;
using strata::kernels::cuda::PagedKvLayout;
using strata::kernels::cuda::PageFormat;

#define CHECK_CUDA(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t e_ = (expr);                                                        \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "cuda_decode_bench: %s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// Finite pseudo-random 16-bit values (sign 0, exponent below 15: every fp16 in [0, 2)).
__global__ void FillKernel(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = static_cast<uint16_t>(x & 0x3bffu);
  }
}

void Fill(void* p, size_t bytes, uint32_t seed) {
  FillKernel<<<1024, 256>>>(static_cast<uint16_t*>(p), bytes / 2, seed);
  CHECK_CUDA(cudaGetLastError());
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of `runs` runs of `launch` (after 3 warm-up runs), timed with CUDA events;
// with `flush`, L2 is flushed before each run (a memset of `flush_bytes`, outside the timed
// region). `launch` returns a status: a failure ends the program, saying why.
template <typename F>
double MedianMs(const Timer& timer, int runs, void* flush, size_t flush_bytes, F launch) {
  std::vector<double> times;
  for (int r = 0; r < runs + 3; ++r) {
    if (flush != nullptr) CHECK_CUDA(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
    CHECK_CUDA(cudaEventRecord(timer.a));
    if (const absl::Status s = launch(); !s.ok()) {
      std::fprintf(stderr, "cuda_decode_bench: %s\n", std::string(s.message()).c_str());
      std::exit(1);
    }
    CHECK_CUDA(cudaEventRecord(timer.b));
    CHECK_CUDA(cudaEventSynchronize(timer.b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, timer.a, timer.b));
    if (r >= 3) times.push_back(ms);
  }
  return Median(times);
}

// The layout of `spec`'s blocks (8 KV heads, head dim 128) of `tokens` tokens; exits saying why
// when the codec or the kernels refuse it.
PagedKvLayout LayoutOf(const char* spec, int tokens) {
  absl::StatusOr<PagedKvLayout> L = strata::kernels::cuda::PageLayoutForCodec(spec, tokens, 8, 128);
  if (!L.ok()) {
    std::fprintf(stderr, "cuda_decode_bench: %s\n", std::string(L.status().message()).c_str());
    std::exit(1);
  }
  return *L;
}

// What the general kernel needs beside a pool of `spec`'s pages: one real block's descriptor
// (every page of the pool uses it: the data is random, the addressing real) and the calibration
// constants (a synthetic calibration for SKVQ and CQ). `force_general`: the general kernel over a
// codec whose pages the fast kernels take (to compare the two on the same pages).
struct General {
  PagedKvLayout layout;
  strata::kernels::cuda::PageDesc desc;
  std::vector<uint8_t> constants;
  double block_bytes = 0;  // one block's bytes, header included
};

General GeneralOf(const char* spec, int tokens, bool force_general) {
  namespace sk = strata::kernels;
  const sk::CodecSpec parsed = *sk::CodecSpec::Parse(spec);
  std::shared_ptr<sk::Calibration> cal;
  if (parsed.needs_calibration()) cal = sk::MakeSyntheticCalibration(parsed, 8, 128, 5);
  auto codec = sk::Codec::Create(spec, cal);
  const sk::SyntheticKv kv = sk::MakeSyntheticKv(tokens, 8, 128, 3);
  absl::StatusOr<strata::AlignedBuffer> block =
      (*codec)->Encode({kv.k.data(), kv.v.data(), strata::SourceDType::kFloat32,
                        static_cast<uint32_t>(tokens), 8, 128},
                       {.layer = 0, .chunk_index = 1});
  if (!block.ok()) {
    std::fprintf(stderr, "cuda_decode_bench: %s\n", std::string(block.status().message()).c_str());
    std::exit(1);
  }
  const strata::BlockView view = *strata::BlockView::Parse(block->span());
  const strata::kernels::cuda::PageConstants constants =
      strata::kernels::cuda::PageConstants::For(cal.get());
  absl::StatusOr<strata::kernels::cuda::PageDesc> desc =
      strata::kernels::cuda::DescribePage(view, cal.get(), &constants);
  absl::StatusOr<PagedKvLayout> L = strata::kernels::cuda::PageLayoutFor(view, cal.get());
  if (!desc.ok() || !L.ok()) {
    std::fprintf(stderr, "cuda_decode_bench: %s: %s\n", spec,
                 std::string((desc.ok() ? L.status() : desc.status()).message()).c_str());
    std::exit(1);
  }
  General g;
  g.layout = *L;
  if (force_general) {
    g.layout.format = PageFormat::kGeneral;
    g.layout.page_tokens = tokens;
  }
  g.desc = *desc;
  g.constants = constants.bytes();
  g.block_bytes = static_cast<double>(block->size());
  return g;
}

// Bytes of a page's sections (what the kernels read of it).
double SectionBytes(const PagedKvLayout& L) {
  const double per_head =
      L.KeyCodeBytes() + L.ValueCodeBytes() +
      (L.format == PageFormat::kAffine ? 2.0 * (L.KeyMetaBytes() + L.ValueMetaBytes()) : 0.0);
  return per_head * L.kv_heads;
}

struct Row {
  std::string kernel;
  int page = 0;
  int batch = 0, context = 0;
  double ms = 0, bytes = 0, gbps = 0, of_copy = 0, speedup = 0;
  int splits = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir;
  int runs = 20;
  bool quick = false;
  int forced_splits = 0;
  std::vector<int> page_sizes = {64, 256};
  std::vector<std::string> only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (a == "--runs" && i + 1 < argc) {
      runs = std::max(3, std::atoi(argv[++i]));
    } else if (a == "--splits" && i + 1 < argc) {
      forced_splits = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--kernels" && i + 1 < argc) {
      only = absl::StrSplit(argv[++i], ',');
    } else if (a == "--page_tokens" && i + 1 < argc) {
      page_sizes.clear();
      for (absl::string_view p : absl::StrSplit(argv[++i], ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(p, &n) || n < 8) {
          std::fprintf(stderr, "cuda_decode_bench: --page_tokens: not a page size: %s\n",
                       std::string(p).c_str());
          return 2;
        }
        page_sizes.push_back(n);
      }
    } else {
      std::fprintf(stderr,
                   "usage: cuda_decode_bench [--out DIR] [--runs N] [--quick] [--splits N] "
                   "[--page_tokens N[,N...]] [--kernels NAME[,NAME...]]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cuda_decode_bench: no GPU here: nothing to measure\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int driver = 0;
  CHECK_CUDA(cudaDriverGetVersion(&driver));
  Timer timer;
  void* flush = nullptr;
  const size_t flush_bytes = size_t{256} << 20;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));

  // The copy ceiling: a 1 GiB device-to-device copy, bytes read plus written.
  double copy_gbps = 0;
  {
    const size_t n = size_t{1} << 30;
    void *src = nullptr, *dst = nullptr;
    CHECK_CUDA(cudaMalloc(&src, n));
    CHECK_CUDA(cudaMalloc(&dst, n));
    Fill(src, n, 7);
    const double ms = MedianMs(timer, runs, nullptr, 0, [&] {
      return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice) == cudaSuccess
                 ? absl::OkStatus()
                 : absl::InternalError("the device-to-device copy failed");
    });
    copy_gbps = 2.0 * n / (ms * 1e-3) / 1e9;
    cudaFree(src);
    cudaFree(dst);
  }

  struct Kernel {
    const char* name;
    const char* spec;
    bool general = false;  // the general kernel (PageFormat::kGeneral), through descriptors
    PagedKernel kernel = PagedKernel::kAuto;
  };
  // The general kernel: over KIVI pages (against the affine kernel on the same pages) and over
  // codecs only it reads. Its rows' bytes are whole blocks.
  const Kernel kernels[] = {
      {"fp16", "fp16"},
      {"affine k4v4 g32", "kivi:k4v4:g32"},
      {"affine k2v2 g32", "kivi:k2v2:g32"},
      // Registers capped for four blocks per multiprocessor, not three.
      {"affine k4v4 4blk", "kivi:k4v4:g32", false, PagedKernel::kMmaFourBlocks},
      {"affine k2v2 4blk", "kivi:k2v2:g32", false, PagedKernel::kMmaFourBlocks},
      {"general k4v4 g32", "kivi:k4v4:g32", true},
      {"general int8", "int8", true},
      {"general gear k4 r4", "gear:k4v4:g32:r4:s2", true},
      {"general skvq k4v4", "skvq:k4v4:g32", true},
      // CQ pools: the codebook kernel (kAuto), and the general kernel on the same pages (kSimt).
      {"codebook cq c4 b8", "cq:c4:b8", true},
      {"codebook cq c8 b8", "cq:c8:b8", true},
      {"codebook cq c2 b5", "cq:c2:b5", true},
      {"general cq c4 b8", "cq:c4:b8", true, PagedKernel::kSimt}};
  std::vector<int> batches = {1, 16, 64}, contexts = {4096, 32768, 131072};
  if (quick) {
    batches = {16};
    contexts = {32768};
  }
  std::vector<Row> rows;
  for (int page : page_sizes) {
    for (int batch : batches) {
      for (int context : contexts) {
        if (context > 32768 && batch > 16) continue;  // 128k at batch 64: 32 GiB of fp16 KV
        double fp16_ms = 0;
        for (const Kernel& k : kernels) {
          if (!only.empty() && std::find(only.begin(), only.end(), k.name) == only.end()) continue;
          General g;
          if (k.general) {
            g = GeneralOf(k.spec, page, true);
          } else {
            g.layout = LayoutOf(k.spec, page);
          }
          const PagedKvLayout& L = g.layout;
          const int pages_per_seq = context / L.page_tokens;
          const size_t pages = static_cast<size_t>(batch) * pages_per_seq;
          const size_t pool_bytes = pages * L.PageBytes();
          void *pool = nullptr, *q = nullptr, *o = nullptr, *work = nullptr, *table = nullptr,
               *counts = nullptr;
          CHECK_CUDA(cudaMalloc(&pool, pool_bytes));
          Fill(pool, pool_bytes, 11);
          std::vector<int32_t> t(pages), c(batch, pages_per_seq);
          for (size_t i = 0; i < pages; ++i)
            t[i] = static_cast<int32_t>((i * 7919) % pages);  // scattered
          CHECK_CUDA(cudaMalloc(&table, t.size() * 4));
          CHECK_CUDA(cudaMemcpy(table, t.data(), t.size() * 4, cudaMemcpyHostToDevice));
          CHECK_CUDA(cudaMalloc(&counts, c.size() * 4));
          CHECK_CUDA(cudaMemcpy(counts, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
          const size_t qn = static_cast<size_t>(batch) * 32 * 128;
          CHECK_CUDA(cudaMalloc(&q, qn * 4));
          CHECK_CUDA(cudaMalloc(&o, qn * 4));
          Fill(q, qn * 4, 13);  // finite floats (two fp16-ranged halves each)
          PagedDecodeArgs a;
          a.pages = static_cast<const uint8_t*>(pool);
          a.block_table = static_cast<const int32_t*>(table);
          a.max_pages = pages_per_seq;
          a.page_counts = static_cast<const int32_t*>(counts);
          a.q = static_cast<const float*>(q);
          a.batch = batch;
          a.q_heads = 32;
          a.out = static_cast<float*>(o);
          a.splits = forced_splits;
          a.kernel = k.kernel;
          void *descs = nullptr, *desc_ids = nullptr, *consts = nullptr;
          if (k.general) {
            CHECK_CUDA(cudaMalloc(&descs, sizeof(g.desc)));
            CHECK_CUDA(cudaMemcpy(descs, &g.desc, sizeof(g.desc), cudaMemcpyHostToDevice));
            CHECK_CUDA(cudaMalloc(&desc_ids, pages * 2));
            CHECK_CUDA(cudaMemset(desc_ids, 0, pages * 2));
            CHECK_CUDA(cudaMalloc(&consts, std::max<size_t>(16, g.constants.size())));
            if (!g.constants.empty()) {
              CHECK_CUDA(cudaMemcpy(consts, g.constants.data(), g.constants.size(),
                                    cudaMemcpyHostToDevice));
            }
            a.page_descs = static_cast<const strata::kernels::cuda::PageDesc*>(descs);
            a.page_desc_ids = static_cast<const uint16_t*>(desc_ids);
            a.constants = static_cast<const uint8_t*>(consts);
          }
          const int splits = strata::kernels::cuda::ChooseSplits(L, a, pages_per_seq);
          CHECK_CUDA(
              cudaMalloc(&work, strata::kernels::cuda::WorkspaceBytes(batch, 32, 128, splits)));
          a.workspace = work;
          a.splits = splits;
          const double ms = MedianMs(timer, runs, flush, flush_bytes, [&] {
            return strata::kernels::cuda::PagedDecode(L, a, pages_per_seq, nullptr);
          });
          Row row;
          row.kernel = k.name;
          row.page = page;
          row.batch = batch;
          row.context = context;
          row.ms = ms;
          row.bytes = static_cast<double>(pages) * (k.general ? g.block_bytes : SectionBytes(L));
          row.gbps = row.bytes / (row.ms * 1e-3) / 1e9;
          row.of_copy = row.gbps / copy_gbps;
          if (L.format == PageFormat::kFp16) fp16_ms = row.ms;
          row.speedup = fp16_ms > 0 ? fp16_ms / row.ms : 0;
          row.splits = splits;
          rows.push_back(row);
          for (void* p : {pool, q, o, work, table, counts, descs, desc_ids, consts}) cudaFree(p);
        }
      }
    }
  }

  // Compression at prefill: 131072 tokens (fp32 K and V, 1 GiB) in chunks of each page size into
  // pages; bytes read plus written against the copy.
  struct Compressed {
    int bits = 0, page = 0;
    double ms = 0, gbps = 0, of_copy = 0;
  };
  std::vector<Compressed> compressed;
  for (int page : page_sizes) {
    for (int bits : {4, 2}) {
      const PagedKvLayout L = LayoutOf(bits == 4 ? "kivi:k4v4:g32" : "kivi:k2v2:g32", page);
      const int chunks = 131072 / page;
      const size_t in_bytes = static_cast<size_t>(chunks) * page * 8 * 128 * 4;
      void *k = nullptr, *v = nullptr, *pages = nullptr, *ids = nullptr;
      CHECK_CUDA(cudaMalloc(&k, in_bytes));
      CHECK_CUDA(cudaMalloc(&v, in_bytes));
      CHECK_CUDA(cudaMalloc(&pages, chunks * L.PageBytes()));
      Fill(k, in_bytes, 17);  // pairs of finite halves: finite floats
      Fill(v, in_bytes, 19);
      std::vector<int32_t> id(chunks);
      for (int i = 0; i < chunks; ++i) id[i] = i;
      CHECK_CUDA(cudaMalloc(&ids, chunks * 4));
      CHECK_CUDA(cudaMemcpy(ids, id.data(), chunks * 4, cudaMemcpyHostToDevice));
      strata::kernels::cuda::CompressArgs a;
      a.k = static_cast<const float*>(k);
      a.v = static_cast<const float*>(v);
      a.chunks = chunks;
      a.pages = static_cast<uint8_t*>(pages);
      a.page_ids = static_cast<const int32_t*>(ids);
      const double ms = MedianMs(timer, runs, flush, flush_bytes, [&] {
        return strata::kernels::cuda::CompressToPages(L, a, nullptr);
      });
      Compressed c;
      c.bits = bits;
      c.page = page;
      c.ms = ms;
      c.gbps = (2.0 * in_bytes + chunks * SectionBytes(L)) / (c.ms * 1e-3) / 1e9;
      c.of_copy = c.gbps / copy_gbps;
      compressed.push_back(c);
      for (void* p : {k, v, pages, ids}) cudaFree(p);
    }
  }

  const strata::bench::GpuRunInfo info = strata::bench::CollectGpuRunInfo(prop, driver);
  std::ostringstream txt;
  txt << info.Header("cuda_decode_bench") << "\n";
  txt << "device-to-device copy: " << copy_gbps << " GB/s (read + write); median of " << runs
      << " runs, L2 flushed before each\n";
  txt << "head dim 128, 32 query heads over 8 KV heads; pages are blocks read in place\n\n";
  char line[256];
  std::snprintf(line, sizeof(line), "%-18s %5s %6s %8s %10s %10s %9s %9s %9s %7s\n", "kernel",
                "page", "batch", "context", "time ms", "MB read", "GB/s", "of copy", "vs fp16",
                "splits");
  txt << line;
  for (const Row& r : rows) {
    std::snprintf(line, sizeof(line), "%-18s %5d %6d %8d %10.4f %10.1f %9.1f %8.1f%% %8.2fx %7d\n",
                  r.kernel.c_str(), r.page, r.batch, r.context, r.ms, r.bytes / 1e6, r.gbps,
                  100 * r.of_copy, r.speedup, r.splits);
    txt << line;
  }
  txt << "\ncompression (KIVI g32, fp32 K and V of 131072 tokens into pages):\n";
  for (const Compressed& c : compressed) {
    std::snprintf(line, sizeof(line),
                  "  k%dv%d, %d-token chunks: %.3f ms, %.1f GB/s read + written, %.1f%% of copy\n",
                  c.bits, c.bits, c.page, c.ms, c.gbps, 100 * c.of_copy);
    txt << line;
  }
  std::fputs(txt.str().c_str(), stdout);
  if (!out_dir.empty()) {
    const std::string base = info.ResultBase(out_dir, "cuda_decode_bench");
    std::ofstream(base + ".txt") << txt.str();
    std::ofstream json(base + ".json");
    json << "{" << info.JsonFields() << ", \"copy_gbps\": " << copy_gbps << ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      json << (i ? ", " : "") << "{\"kernel\": \"" << r.kernel << "\", \"page\": " << r.page
           << ", \"batch\": " << r.batch << ", \"context\": " << r.context << ", \"ms\": " << r.ms
           << ", \"bytes\": " << r.bytes << ", \"gbps\": " << r.gbps
           << ", \"of_copy\": " << r.of_copy << ", \"vs_fp16\": " << r.speedup
           << ", \"splits\": " << r.splits << "}";
    }
    json << "], \"compression\": [";
    for (size_t i = 0; i < compressed.size(); ++i) {
      const Compressed& c = compressed[i];
      json << (i ? ", " : "") << "{\"bits\": " << c.bits << ", \"page\": " << c.page
           << ", \"ms\": " << c.ms << ", \"gbps\": " << c.gbps << ", \"of_copy\": " << c.of_copy
           << "}";
    }
    json << "]}\n";
  }
  cudaFree(flush);
  return 0;
}
