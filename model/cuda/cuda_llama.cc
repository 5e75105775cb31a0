#include "model/cuda/cuda_llama.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/cuda/model_ops.h"

namespace strata::model::cuda {
namespace kc = strata::kernels::cuda;
namespace {

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda model: ", what, ": ", cudaGetErrorString(e)));
}

absl::Status CublasError(cublasStatus_t s, absl::string_view what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda model: ", what, ": ", cublasGetStatusString(s)));
}

cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }
cublasHandle_t Cublas(void* h) { return static_cast<cublasHandle_t>(h); }

std::string Gib(size_t bytes) {
  return absl::StrCat(static_cast<double>(bytes) / (1 << 30), " GiB");
}

}  // namespace

// Per-step buffers, grown to the largest step seen.
struct CudaLlamaModel::Scratch {
  uint32_t rows = 0;
  void* block = nullptr;
  int32_t *ids = nullptr, *positions = nullptr, *next = nullptr;
  float *x = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *o = nullptr,
        *g = nullptr, *u = nullptr, *logits = nullptr;
  void* h = nullptr;  // weight type: [rows, max(hidden, q dim, intermediate)]
  ~Scratch() { cudaFree(block); }
};

CudaLlamaModel::~CudaLlamaModel() {
  scratch_.reset();
  for (void* p : allocations_) cudaFree(p);
  if (cublas_ != nullptr) cublasDestroy(Cublas(cublas_));
  if (stream_ != nullptr) cudaStreamDestroy(Stream(stream_));
}

CudaLlamaModel::DenseKv::~DenseKv() {
  cudaFree(k_);
  cudaFree(v_);
}

absl::StatusOr<std::unique_ptr<CudaLlamaModel>> CudaLlamaModel::Upload(
    const LlamaModel& host, const CudaModelOptions& options) {
  const ModelConfig& c = host.config();
  if (c.head_dim % 32 != 0 || c.head_dim > 256 || c.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda model: head_dim ", c.head_dim, ": the GPU path takes multiples of 32 up to 256"));
  }
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda model: no usable GPU: ",
                     e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device"));
  }
  if (options.device < 0 || options.device >= devices) {
    return absl::FailedPreconditionError(absl::StrCat("cuda model: device cuda:", options.device,
                                                      " does not exist (", devices, " here)"));
  }
  STRATA_RETURN_IF_ERROR(CudaError(cudaSetDevice(options.device), "set device"));
  std::unique_ptr<CudaLlamaModel> m(new CudaLlamaModel());
  m->config_ = c;
  m->options_ = options;

  // What the weights need, against what the device has free.
  const size_t wsize = 2;
  size_t need = host.embed().size() * wsize + host.lm_head().size() * wsize +
                host.final_norm().size() * 4 + host.inv_freq().size() * 4;
  for (const LlamaModel::Layer& l : host.layers()) {
    need += (l.wq.size() + l.wk.size() + l.wv.size() + l.wo.size() + l.w_gate.size() +
             l.w_up.size() + l.w_down.size()) *
                wsize +
            (l.input_norm.size() + l.post_norm.size() + l.bq.size() + l.bk.size() + l.bv.size() +
             l.bo.size()) *
                4;
  }
  size_t free_bytes = 0, total_bytes = 0;
  STRATA_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_bytes, &total_bytes), "memory info"));
  if (need > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda model: the weights need ", Gib(need), " of device memory; cuda:", options.device,
        " has ", Gib(free_bytes), " free of ", Gib(total_bytes)));
  }
  cudaStream_t stream = nullptr;
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  m->stream_ = stream;
  cublasHandle_t handle = nullptr;
  STRATA_RETURN_IF_ERROR(CublasError(cublasCreate(&handle), "cuBLAS"));
  m->cublas_ = handle;
  STRATA_RETURN_IF_ERROR(CublasError(cublasSetStream(handle, stream), "cuBLAS stream"));

  // Uploads (converted to the weight type, or kept fp32), synchronously: loading, not serving.
  std::vector<uint16_t> narrow;
  auto upload = [&](const std::vector<float>& w, bool to_weight_type,
                    const void** out) -> absl::Status {
    if (w.empty()) {
      *out = nullptr;
      return absl::OkStatus();
    }
    const size_t bytes = w.size() * (to_weight_type ? 2 : 4);
    void* d = nullptr;
    STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(&d, bytes), absl::StrCat(bytes, " bytes")));
    m->allocations_.push_back(d);
    m->weight_bytes_ += bytes;
    const void* src = w.data();
    if (to_weight_type) {
      narrow.resize(w.size());
      for (size_t i = 0; i < w.size(); ++i) {
        narrow[i] = options.weights == WeightType::kBf16 ? FloatToBFloat16Bits(w[i])
                                                         : FloatToHalfBits(w[i]);
      }
      src = narrow.data();
    }
    STRATA_RETURN_IF_ERROR(CudaError(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice), "upload"));
    *out = d;
    return absl::OkStatus();
  };
  auto upload_f32 = [&](const std::vector<float>& w, const float** out) {
    const void* p = nullptr;
    absl::Status s = upload(w, false, &p);
    *out = static_cast<const float*>(p);
    return s;
  };
  STRATA_RETURN_IF_ERROR(upload(host.embed(), true, &m->embed_));
  STRATA_RETURN_IF_ERROR(upload(host.lm_head(), true, &m->lm_head_));
  if (m->lm_head_ == nullptr) m->lm_head_ = m->embed_;
  STRATA_RETURN_IF_ERROR(upload_f32(host.final_norm(), &m->norm_));
  STRATA_RETURN_IF_ERROR(upload_f32(host.inv_freq(), &m->inv_freq_));
  for (const LlamaModel::Layer& hl : host.layers()) {
    Layer l;
    STRATA_RETURN_IF_ERROR(upload_f32(hl.input_norm, &l.input_norm));
    STRATA_RETURN_IF_ERROR(upload_f32(hl.post_norm, &l.post_norm));
    STRATA_RETURN_IF_ERROR(upload(hl.wq, true, &l.wq));
    STRATA_RETURN_IF_ERROR(upload(hl.wk, true, &l.wk));
    STRATA_RETURN_IF_ERROR(upload(hl.wv, true, &l.wv));
    STRATA_RETURN_IF_ERROR(upload(hl.wo, true, &l.wo));
    STRATA_RETURN_IF_ERROR(upload(hl.w_gate, true, &l.w_gate));
    STRATA_RETURN_IF_ERROR(upload(hl.w_up, true, &l.w_up));
    STRATA_RETURN_IF_ERROR(upload(hl.w_down, true, &l.w_down));
    STRATA_RETURN_IF_ERROR(upload_f32(hl.bq, &l.bq));
    STRATA_RETURN_IF_ERROR(upload_f32(hl.bk, &l.bk));
    STRATA_RETURN_IF_ERROR(upload_f32(hl.bv, &l.bv));
    STRATA_RETURN_IF_ERROR(upload_f32(hl.bo, &l.bo));
    m->layers_.push_back(l);
  }
  return m;
}

absl::StatusOr<std::unique_ptr<CudaLlamaModel::DenseKv>> CudaLlamaModel::NewKv(
    uint32_t capacity) const {
  const ModelConfig& c = config_;
  if (capacity == 0) return absl::InvalidArgumentError("cuda model: a KV cache of 0 tokens");
  const size_t per = size_t{c.num_layers} * c.num_kv_heads * capacity * c.head_dim * sizeof(float);
  STRATA_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "set device"));
  size_t free_bytes = 0, total_bytes = 0;
  STRATA_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_bytes, &total_bytes), "memory info"));
  if (2 * per > free_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda model: a full-precision KV cache of ", capacity, " tokens needs ",
                     Gib(2 * per), "; cuda:", options_.device, " has ", Gib(free_bytes), " free"));
  }
  std::unique_ptr<DenseKv> kv(new DenseKv());
  STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(&kv->k_, per), "KV cache"));
  STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(&kv->v_, per), "KV cache"));
  kv->capacity_ = capacity;
  kv->bytes_ = 2 * per;
  return kv;
}

absl::Status CudaLlamaModel::EnsureScratch(uint32_t rows) const {
  if (scratch_ != nullptr && scratch_->rows >= rows) return absl::OkStatus();
  const ModelConfig& c = config_;
  const size_t hs = c.hidden_size, qd = size_t{c.num_heads} * c.head_dim,
               kvd = size_t{c.num_kv_heads} * c.head_dim, ff = c.intermediate_size,
               vocab = c.vocab_size;
  const size_t wide = std::max({hs, qd, ff});
  auto s = std::make_unique<Scratch>();
  s->rows = rows;
  // One allocation, carved in 256-byte aligned pieces.
  std::vector<std::pair<void**, size_t>> pieces = {
      {reinterpret_cast<void**>(&s->ids), rows * 4},
      {reinterpret_cast<void**>(&s->positions), rows * 4},
      {reinterpret_cast<void**>(&s->next), 4},
      {reinterpret_cast<void**>(&s->x), rows * hs * 4},
      {reinterpret_cast<void**>(&s->q), rows * qd * 4},
      {reinterpret_cast<void**>(&s->k), rows * kvd * 4},
      {reinterpret_cast<void**>(&s->v), rows * kvd * 4},
      {reinterpret_cast<void**>(&s->att), rows * qd * 4},
      {reinterpret_cast<void**>(&s->o), rows * hs * 4},
      {reinterpret_cast<void**>(&s->g), rows * ff * 4},
      {reinterpret_cast<void**>(&s->u), rows * ff * 4},
      {reinterpret_cast<void**>(&s->logits), rows * vocab * 4},
      {&s->h, rows * wide * 2}};
  size_t total = 0;
  for (const auto& [p, bytes] : pieces) total += (bytes + 255) / 256 * 256;
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMalloc(&s->block, total), absl::StrCat(total, " bytes of scratch")));
  uint8_t* at = static_cast<uint8_t*>(s->block);
  for (const auto& [p, bytes] : pieces) {
    *p = at;
    at += (bytes + 255) / 256 * 256;
  }
  scratch_ = std::move(s);
  return absl::OkStatus();
}

// y[rows, out] = x[rows, in] . W^T with W [out, in] row-major: in cuBLAS's column-major terms
// y^T (out x rows) = W (as the transpose of its in x out column-major view) times x^T.
absl::Status CudaLlamaModel::Gemm(const void* x, int rows, int in, const void* w, int out,
                                  float* y) const {
  const float alpha = 1, beta = 0;
  const cudaDataType t = options_.weights == WeightType::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  return CublasError(
      cublasGemmEx(Cublas(cublas_), CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, w, t, in, x, t,
                   in, &beta, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "GEMM");
}

namespace {

// The model_ops calls for the weight type T.
template <typename T>
struct Ops {
  static absl::Status Embed(const void* table, const int32_t* ids, int rows, int hidden, float* x,
                            cudaStream_t s) {
    return kc::EmbedRows<T>(static_cast<const T*>(table), ids, rows, hidden, x, s);
  }
  static absl::Status Norm(const float* x, const float* w, int rows, int d, double eps, void* out,
                           cudaStream_t s) {
    return kc::RmsNormRows<T>(x, w, rows, d, eps, static_cast<T*>(out), s);
  }
  static absl::Status Glu(const float* g, const float* u, size_t n, void* out, cudaStream_t s) {
    return kc::SwiGlu<T>(g, u, n, static_cast<T*>(out), s);
  }
  static absl::Status ToWeightType(const float* in, size_t n, void* out, cudaStream_t s) {
    return kc::Narrow<T>(in, n, static_cast<T*>(out), s);
  }
};

}  // namespace

absl::StatusOr<uint32_t> CudaLlamaModel::Step(absl::Span<const uint32_t> tokens, DenseKv* kv,
                                              std::vector<float>* logits) const {
  const ModelConfig& c = config_;
  if (tokens.empty()) return absl::InvalidArgumentError("cuda model: a step of no tokens");
  if (kv == nullptr) return absl::InvalidArgumentError("cuda model: no KV cache");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("cuda model: token ", i, " is ", tokens[i],
                                                     ", beyond the vocabulary of ", c.vocab_size));
    }
  }
  if (kv->tokens_ + tokens.size() > kv->capacity_) {
    return absl::InvalidArgumentError(absl::StrCat("cuda model: ", kv->tokens_ + tokens.size(),
                                                   " tokens exceed the KV cache's capacity of ",
                                                   kv->capacity_));
  }
  if (c.sliding_window != 0 && kv->tokens_ + tokens.size() > c.sliding_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda model: ", kv->tokens_ + tokens.size(), " tokens exceed the sliding window of ",
        c.sliding_window, "; sliding-window attention is not implemented"));
  }
  STRATA_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "set device"));
  const int n = static_cast<int>(tokens.size());
  STRATA_RETURN_IF_ERROR(EnsureScratch(static_cast<uint32_t>(n)));
  Scratch& s = *scratch_;
  cudaStream_t st = Stream(stream_);
  const bool bf16 = options_.weights == WeightType::kBf16;
  auto embed = bf16 ? Ops<__nv_bfloat16>::Embed : Ops<__half>::Embed;
  auto norm = bf16 ? Ops<__nv_bfloat16>::Norm : Ops<__half>::Norm;
  auto glu = bf16 ? Ops<__nv_bfloat16>::Glu : Ops<__half>::Glu;
  auto to_w = bf16 ? Ops<__nv_bfloat16>::ToWeightType : Ops<__half>::ToWeightType;

  std::vector<int32_t> ids(tokens.begin(), tokens.end()), pos(n);
  for (int i = 0; i < n; ++i) pos[i] = static_cast<int32_t>(kv->tokens_ + i);
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(s.ids, ids.data(), n * 4, cudaMemcpyHostToDevice, st), "tokens"));
  STRATA_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(s.positions, pos.data(), n * 4, cudaMemcpyHostToDevice, st), "positions"));
  const int hs = static_cast<int>(c.hidden_size), H = static_cast<int>(c.num_heads),
            KH = static_cast<int>(c.num_kv_heads), D = static_cast<int>(c.head_dim),
            ff = static_cast<int>(c.intermediate_size), vocab = static_cast<int>(c.vocab_size);
  const int qd = H * D, kvd = KH * D;
  const size_t layer_kv = size_t{c.num_kv_heads} * kv->capacity_ * c.head_dim;
  STRATA_RETURN_IF_ERROR(embed(embed_, s.ids, n, hs, s.x, st));
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    const Layer& l = layers_[li];
    STRATA_RETURN_IF_ERROR(norm(s.x, l.input_norm, n, hs, c.rms_norm_eps, s.h, st));
    STRATA_RETURN_IF_ERROR(Gemm(s.h, n, hs, l.wq, qd, s.q));
    STRATA_RETURN_IF_ERROR(Gemm(s.h, n, hs, l.wk, kvd, s.k));
    STRATA_RETURN_IF_ERROR(Gemm(s.h, n, hs, l.wv, kvd, s.v));
    if (l.bq != nullptr) STRATA_RETURN_IF_ERROR(kc::AddBias(s.q, l.bq, n, qd, st));
    if (l.bk != nullptr) STRATA_RETURN_IF_ERROR(kc::AddBias(s.k, l.bk, n, kvd, st));
    if (l.bv != nullptr) STRATA_RETURN_IF_ERROR(kc::AddBias(s.v, l.bv, n, kvd, st));
    STRATA_RETURN_IF_ERROR(kc::Rope(s.q, s.positions, inv_freq_, n, H, D, st));
    STRATA_RETURN_IF_ERROR(kc::Rope(s.k, s.positions, inv_freq_, n, KH, D, st));
    float* ck = kv->k_ + li * layer_kv;
    float* cv = kv->v_ + li * layer_kv;
    STRATA_RETURN_IF_ERROR(
        kc::WriteKv(s.k, s.v, s.positions, n, KH, D, static_cast<int>(kv->capacity_), ck, cv, st));
    STRATA_RETURN_IF_ERROR(kc::DenseAttention({.q = s.q,
                                               .k = ck,
                                               .v = cv,
                                               .positions = s.positions,
                                               .out = s.att,
                                               .rows = n,
                                               .q_heads = H,
                                               .kv_heads = KH,
                                               .head_dim = D,
                                               .capacity = static_cast<int>(kv->capacity_)},
                                              st));
    STRATA_RETURN_IF_ERROR(to_w(s.att, size_t(n) * qd, s.h, st));
    STRATA_RETURN_IF_ERROR(Gemm(s.h, n, qd, l.wo, hs, s.o));
    if (l.bo != nullptr) STRATA_RETURN_IF_ERROR(kc::AddBias(s.o, l.bo, n, hs, st));
    STRATA_RETURN_IF_ERROR(kc::AddInPlace(s.x, s.o, size_t(n) * hs, st));
    STRATA_RETURN_IF_ERROR(norm(s.x, l.post_norm, n, hs, c.rms_norm_eps, s.h, st));
    STRATA_RETURN_IF_ERROR(Gemm(s.h, n, hs, l.w_gate, ff, s.g));
    STRATA_RETURN_IF_ERROR(Gemm(s.h, n, hs, l.w_up, ff, s.u));
    STRATA_RETURN_IF_ERROR(glu(s.g, s.u, size_t(n) * ff, s.h, st));
    STRATA_RETURN_IF_ERROR(Gemm(s.h, n, ff, l.w_down, hs, s.o));
    STRATA_RETURN_IF_ERROR(kc::AddInPlace(s.x, s.o, size_t(n) * hs, st));
  }
  // The final norm and the vocabulary: every row when the logits are wanted, else the last.
  const int first = logits != nullptr ? 0 : n - 1;
  const int rows = n - first;
  STRATA_RETURN_IF_ERROR(norm(s.x + size_t(first) * hs, norm_, rows, hs, c.rms_norm_eps, s.h, st));
  STRATA_RETURN_IF_ERROR(Gemm(s.h, rows, hs, lm_head_, vocab, s.logits));
  STRATA_RETURN_IF_ERROR(kc::ArgmaxRows(s.logits + size_t(rows - 1) * vocab, 1, vocab, s.next, st));
  int32_t next = 0;
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(&next, s.next, 4, cudaMemcpyDeviceToHost, st), "next token"));
  if (logits != nullptr) {
    logits->resize(size_t(n) * vocab);
    STRATA_RETURN_IF_ERROR(CudaError(
        cudaMemcpyAsync(logits->data(), s.logits, logits->size() * 4, cudaMemcpyDeviceToHost, st),
        "logits"));
  }
  STRATA_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(st), "step"));
  kv->tokens_ += static_cast<uint32_t>(n);
  return static_cast<uint32_t>(next);
}

}  // namespace strata::model::cuda
