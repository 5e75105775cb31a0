// The model on the GPU (model/cuda/cuda_llama.h) at an 8B model's shape with random weights
// (32 layers, hidden 4096, 32 query heads over 8 KV heads, head dim 128, SwiGLU 14336, vocabulary
// 128256; bf16 weights), against the device-to-device copy rate and the bf16 GEMM rate measured in
// the same run:
//   - decode: one DecodePaged step (every layer's attention over pages of 256-token blocks read in
//     place, plus the window) at batch 1 / 16 / 64 x context 4k / 32k, KV fp16 / kivi 4-bit /
//     kivi 2-bit, against its memory floor: (weight bytes + KV bytes read) / copy rate. A shape
//     whose pages do not fit the device is a row of the capacity table instead. Each step is
//     timed as served (a CUDA graph replayed) and with every kernel launched by itself.
//   - capacity: the largest batch whose pages fit at 32k context, per codec.
//   - prefill: a 4k prompt through Step (dense attention on the tensor cores, full-precision KV)
//     in tokens/s, and its share of the GEMM rate (the model's flops, attention included); and
//     the same with the exact fp32 attention kernel.
// Times are medians of CUDA-event-timed runs. bench/cuda_model_torch.py times PyTorch at the same
// shapes (the reference a user would otherwise write); run both in one call.
//
//   cuda_model_bench [--out DIR] [--runs N] [--quick]
// (--quick: batch 16 at 32k and the prefill only). Writes DIR/cuda_model_bench-<device>-<date>-
// <commit>.{txt,json} (commit from $STRATA_COMMIT). Exits 1 without a GPU, saying so.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/eight_b_config.h"
#include "bench/gpu_run_info.h"
#include "kernels/cuda/block_pages.h"
#include "kernels/cuda/model_ops.h"
#include "model/config.h"
#include "model/cuda/cuda_llama.h"

namespace {

namespace kc = strata::kernels::cuda;
using strata::model::ModelConfig;
using strata::model::cuda::CudaLlamaModel;

#define CHECK_CUDA(expr)                                                                 \
  do {                                                                                   \
    const cudaError_t e_ = (expr);                                                       \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "cuda_model_bench: %s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_model_bench: %s: %s\n", what, std::string(s.ToString()).c_str());
    std::exit(1);
  }
}

// Median milliseconds of `runs` runs of `fn` after 2 warm-up runs, timed with CUDA events on the
// default stream's clock (fn synchronizes its own stream).
double MedianMs(int runs, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < runs + 2; ++r) {
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaEventRecord(a));
    fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct DecodeRow {
  std::string codec;
  int batch = 0, context = 0;
  bool fits = true;
  double ms = 0, floor_ms = 0, gbytes = 0, tokens_per_s = 0;
  double eager_ms = 0;  // the same step with every kernel launched by itself (no CUDA graph)
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir;
  int runs = 10;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (a == "--runs" && i + 1 < argc) {
      runs = std::max(3, std::atoi(argv[++i]));
    } else if (a == "--quick") {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: cuda_model_bench [--out DIR] [--runs N] [--quick]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cuda_model_bench: no GPU here: nothing to measure\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int driver = 0;
  CHECK_CUDA(cudaDriverGetVersion(&driver));

  // The copy rate: 1 GiB device to device, bytes read plus written.
  double copy_gbps = 0;
  {
    const size_t n = size_t{1} << 30;
    void *src, *dst;
    CHECK_CUDA(cudaMalloc(&src, n));
    CHECK_CUDA(cudaMalloc(&dst, n));
    const double ms =
        MedianMs(runs, [&] { CHECK_CUDA(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice)); });
    copy_gbps = 2.0 * n / (ms * 1e-3) / 1e9;
    cudaFree(src);
    cudaFree(dst);
  }
  // The bf16 GEMM rate: [4096 x 4096] x [4096 x 14336], fp32 accumulation (the MLP's shape).
  double gemm_tflops = 0;
  {
    const int m = 14336, n = 4096, k = 4096;
    void *A, *B, *C;
    CHECK_CUDA(cudaMalloc(&A, size_t(m) * k * 2));
    CHECK_CUDA(cudaMalloc(&B, size_t(k) * n * 2));
    CHECK_CUDA(cudaMalloc(&C, size_t(m) * n * 4));
    Check(kc::FillUniform(static_cast<__nv_bfloat16*>(A), size_t(m) * k, 0.02f, 1, nullptr),
          "fill");
    Check(kc::FillUniform(static_cast<__nv_bfloat16*>(B), size_t(k) * n, 1.0f, 2, nullptr), "fill");
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
      Check(absl::InternalError("cublasCreate"), "cuBLAS");
    const float alpha = 1, beta = 0;
    const double ms = MedianMs(runs, [&] {
      if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, A, CUDA_R_16BF, k, B,
                       CUDA_R_16BF, k, &beta, C, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        Check(absl::InternalError("cublasGemmEx"), "GEMM");
      }
      CHECK_CUDA(cudaDeviceSynchronize());
    });
    gemm_tflops = 2.0 * m * n * k / (ms * 1e-3) / 1e12;
    cublasDestroy(h);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
  }

  const ModelConfig cfg = strata::bench::EightBConfig();
  absl::StatusOr<std::unique_ptr<CudaLlamaModel>> model = CudaLlamaModel::Random(cfg, {});
  Check(model.status(), "the 8B-shaped model");
  const double weight_bytes = static_cast<double>((*model)->weight_bytes());
  const uint32_t L = cfg.num_layers, KH = cfg.num_kv_heads, D = cfg.head_dim;
  constexpr int kPage = 256, kMaxWindow = 16;

  struct Codec {
    const char* name;
    const char* spec;
  };
  const Codec codecs[] = {
      {"fp16", "fp16"}, {"kivi 4-bit g32", "kivi:k4v4:g32"}, {"kivi 2-bit g32", "kivi:k2v2:g32"}};
  std::vector<int> batches = {1, 16, 64}, contexts = {4096, 32768};
  if (quick) {
    batches = {16};
    contexts = {32768};
  }
  std::vector<DecodeRow> rows;
  struct Capacity {
    std::string codec;
    double page_mb = 0;
    int max_batch = 0;
  };
  std::vector<Capacity> capacity;
  for (const Codec& codec : codecs) {
    absl::StatusOr<kc::PagedKvLayout> layout = kc::PageLayoutForCodec(codec.spec, kPage, KH, D);
    Check(layout.status(), codec.spec);
    const size_t page = layout->PageBytes();
    const double section_bytes =
        KH * (layout->KeyCodeBytes() + layout->ValueCodeBytes() +
              (layout->format == kc::PageFormat::kAffine
                   ? 2.0 * (layout->KeyMetaBytes() + layout->ValueMetaBytes())
                   : 0.0));
    size_t free_bytes = 0, total_bytes = 0;
    CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
    const size_t usable = free_bytes > (size_t{3} << 30) ? free_bytes - (size_t{3} << 30) : 0;
    const size_t per_seq_32k = size_t(L) * (32768 / kPage) * page;
    capacity.push_back({codec.name, page / 1e6, static_cast<int>(usable / per_seq_32k)});
    for (int batch : batches) {
      for (int context : contexts) {
        DecodeRow row;
        row.codec = codec.name;
        row.batch = batch;
        row.context = context;
        const int pages_per_seq = context / kPage;
        const size_t pages = size_t(L) * batch * pages_per_seq;
        const size_t window_bytes = size_t(L) * batch * KH * kMaxWindow * D * 2 * 2;
        if (pages * page + window_bytes > usable) {
          row.fits = false;
          rows.push_back(row);
          continue;
        }
        void *pool, *wk, *wv, *tables, *counts;
        CHECK_CUDA(cudaMalloc(&pool, pages * page));
        // Finite fp16 values everywhere (keys, values, scales, zero points; random codes).
        Check(kc::FillUniform(static_cast<__half*>(pool), pages * page / 2, 1.0f, 7, nullptr),
              "fill pages");
        CHECK_CUDA(cudaMalloc(&wk, window_bytes / 2));
        CHECK_CUDA(cudaMalloc(&wv, window_bytes / 2));
        Check(kc::FillUniform(static_cast<__half*>(wk), window_bytes / 4, 1.0f, 8, nullptr),
              "fill");
        Check(kc::FillUniform(static_cast<__half*>(wv), window_bytes / 4, 1.0f, 9, nullptr),
              "fill");
        // Layer l, sequence b, page i at pool page (l * batch + b) * pages_per_seq + i, scattered
        // by a stride so that neighbours in a table are not neighbours in memory.
        std::vector<int32_t> t(pages);
        for (size_t i = 0; i < pages; ++i) t[i] = static_cast<int32_t>((i * 7919) % pages);
        CHECK_CUDA(cudaMalloc(&tables, pages * 4));
        CHECK_CUDA(cudaMemcpy(tables, t.data(), pages * 4, cudaMemcpyHostToDevice));
        std::vector<int32_t> c(batch, pages_per_seq);
        CHECK_CUDA(cudaMalloc(&counts, batch * 4));
        CHECK_CUDA(cudaMemcpy(counts, c.data(), batch * 4, cudaMemcpyHostToDevice));
        std::vector<const int32_t*> table_ptrs;
        for (uint32_t l = 0; l < L; ++l) {
          table_ptrs.push_back(static_cast<const int32_t*>(tables) +
                               size_t(l) * batch * pages_per_seq);
        }
        std::vector<uint32_t> tokens(batch, 1000);
        std::vector<int32_t> positions(batch, context), slots(batch), lens(batch, 0);
        for (int b = 0; b < batch; ++b) slots[b] = b;
        CudaLlamaModel::PagedStep step;
        step.tokens = tokens;
        step.positions = positions;
        step.window_slots = slots;
        step.window_lens = lens;
        step.layout = *layout;
        step.pages = static_cast<const uint8_t*>(pool);
        step.block_tables = table_ptrs;
        step.max_pages = pages_per_seq;
        step.page_counts = static_cast<const int32_t*>(counts);
        step.max_pages_in_batch = pages_per_seq;
        step.window_k = static_cast<__half*>(wk);
        step.window_v = static_cast<__half*>(wv);
        step.slots = batch;
        step.max_window = kMaxWindow;
        row.ms = MedianMs(runs, [&] { Check((*model)->DecodePaged(step).status(), "decode"); });
        (*model)->SetCudaGraphs(false);
        row.eager_ms =
            MedianMs(runs, [&] { Check((*model)->DecodePaged(step).status(), "decode"); });
        (*model)->SetCudaGraphs(true);
        const double kv_read = double(pages) * section_bytes;
        row.gbytes = (weight_bytes + kv_read) / 1e9;
        row.floor_ms = (weight_bytes + kv_read) / (copy_gbps * 1e9) * 1e3;
        row.tokens_per_s = batch / (row.ms * 1e-3);
        rows.push_back(row);
        for (void* p : {pool, wk, wv, tables, counts}) cudaFree(p);
      }
    }
  }

  // Prefill: a 4k prompt through Step (dense attention over full-precision KV).
  const int prompt = 4096;
  double prefill_ms = 0, prefill_tflops = 0, prefill_exact_ms = 0;
  {
    absl::StatusOr<std::unique_ptr<CudaLlamaModel::DenseKv>> kv = (*model)->NewKv(prompt);
    Check(kv.status(), "prefill KV");
    std::vector<uint32_t> ids(prompt);
    for (int i = 0; i < prompt; ++i) ids[i] = static_cast<uint32_t>((i * 7919) % cfg.vocab_size);
    prefill_ms = MedianMs(std::max(3, runs / 3), [&] {
      (*kv)->Clear();  // the same memory each run: no allocation timed
      Check((*model)->Step(ids, kv->get()).status(), "prefill");
    });
    // The exact (fp32 SIMT) attention for comparison, three runs.
    (*model)->SetExactAttention(true);
    prefill_exact_ms = MedianMs(3, [&] {
      (*kv)->Clear();
      Check((*model)->Step(ids, kv->get()).status(), "prefill");
    });
    (*model)->SetExactAttention(false);
    // The layers' products for every token (weights less the embedding and the vocabulary
    // matrix, at 2 bytes a parameter), the vocabulary for the last token only, and attention
    // (QK^T and PV over the causal half).
    const double layer_params = (weight_bytes - 2.0 * cfg.vocab_size * cfg.hidden_size * 2) / 2;
    const double attn = 4.0 * L * double(prompt) * prompt / 2 * cfg.num_heads * D;
    prefill_tflops = (2.0 * layer_params * prompt + 2.0 * cfg.vocab_size * cfg.hidden_size + attn) /
                     (prefill_ms * 1e-3) / 1e12;
  }

  const strata::bench::GpuRunInfo info = strata::bench::CollectGpuRunInfo(prop, driver);
  std::ostringstream txt;
  txt << info.Header("cuda_model_bench") << "\n";
  txt << "8B shape, random bf16 weights (" << weight_bytes / 1e9 << " GB); copy " << copy_gbps
      << " GB/s (read + write); bf16 GEMM " << gemm_tflops << " TFLOP/s; medians of " << runs
      << " runs\n\ndecode step (pages of " << kPage << " tokens read in place + window):\n";
  char line[256];
  std::snprintf(line, sizeof(line), "%-16s %6s %8s %10s %10s %10s %9s %12s %12s\n", "KV", "batch",
                "context", "time ms", "floor ms", "x floor", "GB read", "tokens/s", "no graph ms");
  txt << line;
  for (const DecodeRow& r : rows) {
    if (!r.fits) {
      std::snprintf(line, sizeof(line),
                    "%-16s %6d %8d   does not fit the device (capacity table)\n", r.codec.c_str(),
                    r.batch, r.context);
    } else {
      std::snprintf(line, sizeof(line), "%-16s %6d %8d %10.3f %10.3f %9.2fx %9.2f %12.1f %12.3f\n",
                    r.codec.c_str(), r.batch, r.context, r.ms, r.floor_ms, r.ms / r.floor_ms,
                    r.gbytes, r.tokens_per_s, r.eager_ms);
    }
    txt << line;
  }
  txt << "\ncapacity at 32k context (device memory less the weights and 3 GiB):\n";
  for (const Capacity& c : capacity) {
    std::snprintf(line, sizeof(line), "  %-16s %7.3f MB per page, batch up to %d\n",
                  c.codec.c_str(), c.page_mb, c.max_batch);
    txt << line;
  }
  std::snprintf(line, sizeof(line),
                "\nprefill of %d tokens (dense attention on the tensor cores): %.1f ms, %.0f "
                "tokens/s, %.1f TFLOP/s (%.0f%% of the GEMM rate); with the exact fp32 "
                "attention: %.1f ms\n",
                prompt, prefill_ms, prompt / (prefill_ms * 1e-3), prefill_tflops,
                100 * prefill_tflops / gemm_tflops, prefill_exact_ms);
  txt << line;
  std::fputs(txt.str().c_str(), stdout);
  if (!out_dir.empty()) {
    const std::string base = info.ResultBase(out_dir, "cuda_model_bench");
    std::ofstream(base + ".txt") << txt.str();
    std::ofstream json(base + ".json");
    json << "{" << info.JsonFields() << ", \"copy_gbps\": " << copy_gbps
         << ", \"gemm_tflops\": " << gemm_tflops << ", \"weight_bytes\": " << weight_bytes
         << ", \"decode\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const DecodeRow& r = rows[i];
      json << (i ? ", " : "") << "{\"kv\": \"" << r.codec << "\", \"batch\": " << r.batch
           << ", \"context\": " << r.context << ", \"fits\": " << (r.fits ? "true" : "false")
           << ", \"ms\": " << r.ms << ", \"floor_ms\": " << r.floor_ms
           << ", \"tokens_per_s\": " << r.tokens_per_s << ", \"no_graph_ms\": " << r.eager_ms
           << "}";
    }
    json << "], \"capacity_32k\": [";
    for (size_t i = 0; i < capacity.size(); ++i) {
      json << (i ? ", " : "") << "{\"kv\": \"" << capacity[i].codec
           << "\", \"max_batch\": " << capacity[i].max_batch << "}";
    }
    json << "], \"prefill\": {\"tokens\": " << prompt << ", \"ms\": " << prefill_ms
         << ", \"tflops\": " << prefill_tflops << ", \"exact_attention_ms\": " << prefill_exact_ms
         << "}}\n";
  }
  return 0;
}
