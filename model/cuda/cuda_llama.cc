#include "model/cuda/cuda_llama.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/cuda/model_ops.h"
#include "model/cuda/cublas_library.h"

namespace strata::model::cuda {
namespace kc = strata::kernels::cuda;
namespace {

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda model: ", what, ": ", cudaGetErrorString(e)));
}

absl::Status CublasError(const CublasLibrary& lib, cublasStatus_t s, absl::string_view what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda model: ", what, ": ", lib.status_string(s)));
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
        *g = nullptr, *u = nullptr;
  float* logits = nullptr;  // [logit_rows, vocab], allocated apart: most steps need one row
  uint32_t logit_rows = 0;
  void* h = nullptr;  // weight type: [rows, max(hidden, q dim, intermediate)]
  ~Scratch() {
    cudaFree(block);
    cudaFree(logits);
  }
};

CudaLlamaModel::~CudaLlamaModel() {
  if (graph_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_));
  scratch_.reset();
  cudaFree(paged_);
  for (void* p : allocations_) cudaFree(p);
  if (cublas_ != nullptr) blas_->destroy(Cublas(cublas_));
  if (stream_ != nullptr) cudaStreamDestroy(Stream(stream_));
}

CudaLlamaModel::DenseKv::~DenseKv() {
  cudaFree(k_);
  cudaFree(v_);
}

absl::Status CudaLlamaModel::Init(const ModelConfig& c, const CudaModelOptions& options) {
  if (c.head_dim % 32 != 0 || c.head_dim > 256) {
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
  config_ = c;
  options_ = options;
  cudaStream_t stream = nullptr;
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  stream_ = stream;
  cublasHandle_t handle = nullptr;
  STRATA_ASSIGN_OR_RETURN(blas_, LoadCublas());
  STRATA_RETURN_IF_ERROR(CublasError(*blas_, blas_->create(&handle), "cuBLAS"));
  cublas_ = handle;
  STRATA_RETURN_IF_ERROR(CublasError(*blas_, blas_->set_stream(handle, stream), "cuBLAS stream"));
  // cuBLAS's workspace given, not allocated by it: a captured graph may hold no allocation.
  constexpr size_t kCublasWorkspace = size_t{32} << 20;
  STRATA_ASSIGN_OR_RETURN(void* workspace, Alloc(kCublasWorkspace, "cuBLAS workspace"));
  return CublasError(*blas_, blas_->set_workspace(handle, workspace, kCublasWorkspace),
                     "cuBLAS workspace");
}

absl::StatusOr<void*> CudaLlamaModel::Alloc(size_t bytes, absl::string_view what) {
  void* d = nullptr;
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMalloc(&d, bytes), absl::StrCat(what, ": ", bytes, " bytes")));
  allocations_.push_back(d);
  weight_bytes_ += bytes;
  return d;
}

namespace {

// What a model of this shape's weights take on the device (products' inputs at 2 bytes, norms
// and biases at 4), and a check against what the device has free.
size_t WeightBytes(const ModelConfig& c) {
  const size_t hs = c.hidden_size, qd = size_t{c.num_heads} * c.head_dim,
               kvd = size_t{c.num_kv_heads} * c.head_dim, ff = c.intermediate_size;
  size_t per_layer = (hs * qd + 2 * hs * kvd + qd * hs + 3 * hs * ff) * 2 + 2 * hs * 4;
  if (c.attention_bias) per_layer += (qd + 2 * kvd + hs) * 4;
  return size_t{c.num_layers} * per_layer +
         size_t{c.vocab_size} * hs * 2 * (c.tie_word_embeddings ? 1 : 2) + hs * 4 +
         c.head_dim / 2 * 4;
}

absl::Status CheckRoom(size_t need, int device, absl::string_view what) {
  size_t free_bytes = 0, total_bytes = 0;
  STRATA_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_bytes, &total_bytes), "memory info"));
  if (need > free_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda model: ", what, " need ", Gib(need), " of device memory; cuda:", device,
                     " has ", Gib(free_bytes), " free of ", Gib(total_bytes)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaLlamaModel>> CudaLlamaModel::Upload(
    const LlamaModel& host, const CudaModelOptions& options) {
  std::unique_ptr<CudaLlamaModel> m(new CudaLlamaModel());
  STRATA_RETURN_IF_ERROR(m->Init(host.config(), options));
  STRATA_RETURN_IF_ERROR(CheckRoom(WeightBytes(host.config()), options.device, "the weights"));

  // Uploads (converted to the weight type, or kept fp32), synchronously: loading, not serving.
  std::vector<uint16_t> narrow;
  auto upload = [&](const std::vector<float>& w, bool to_weight_type,
                    const void** out) -> absl::Status {
    if (w.empty()) {
      *out = nullptr;
      return absl::OkStatus();
    }
    const size_t bytes = w.size() * (to_weight_type ? 2 : 4);
    STRATA_ASSIGN_OR_RETURN(void* d, m->Alloc(bytes, "weights"));
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

absl::StatusOr<std::unique_ptr<CudaLlamaModel>> CudaLlamaModel::Random(
    const ModelConfig& c, const CudaModelOptions& options, uint64_t seed) {
  STRATA_RETURN_IF_ERROR(c.Validate());
  std::unique_ptr<CudaLlamaModel> m(new CudaLlamaModel());
  STRATA_RETURN_IF_ERROR(m->Init(c, options));
  STRATA_RETURN_IF_ERROR(CheckRoom(WeightBytes(c), options.device, "the weights"));
  cudaStream_t st = Stream(m->stream_);
  const bool bf16 = options.weights == WeightType::kBf16;
  // A matrix [out, in] uniform in +-1/sqrt(in) (activations keep their scale through the layers).
  auto matrix = [&](size_t out, size_t in, const void** p) -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(void* d, m->Alloc(out * in * 2, "weights"));
    const float scale = 1.0f / std::sqrt(static_cast<float>(in));
    ++seed;
    STRATA_RETURN_IF_ERROR(
        bf16 ? kc::FillUniform(static_cast<__nv_bfloat16*>(d), out * in, scale, seed, st)
             : kc::FillUniform(static_cast<__half*>(d), out * in, scale, seed, st));
    *p = d;
    return absl::OkStatus();
  };
  const std::vector<float> ones(c.hidden_size, 1.0f);
  auto norm = [&](const float** p) -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(void* d, m->Alloc(ones.size() * 4, "norm"));
    STRATA_RETURN_IF_ERROR(
        CudaError(cudaMemcpy(d, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice), "upload"));
    *p = static_cast<const float*>(d);
    return absl::OkStatus();
  };
  const size_t hs = c.hidden_size, qd = size_t{c.num_heads} * c.head_dim,
               kvd = size_t{c.num_kv_heads} * c.head_dim, ff = c.intermediate_size;
  STRATA_RETURN_IF_ERROR(matrix(c.vocab_size, hs, &m->embed_));
  m->lm_head_ = m->embed_;
  if (!c.tie_word_embeddings) STRATA_RETURN_IF_ERROR(matrix(c.vocab_size, hs, &m->lm_head_));
  STRATA_RETURN_IF_ERROR(norm(&m->norm_));
  std::vector<float> inv(c.head_dim / 2);
  for (size_t i = 0; i < inv.size(); ++i) {
    inv[i] = static_cast<float>(1.0 / std::pow(c.rope_theta, 2.0 * i / c.head_dim));
  }
  STRATA_ASSIGN_OR_RETURN(void* dinv, m->Alloc(inv.size() * 4, "rope"));
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMemcpy(dinv, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice), "upload"));
  m->inv_freq_ = static_cast<const float*>(dinv);
  for (uint32_t li = 0; li < c.num_layers; ++li) {
    Layer l;
    STRATA_RETURN_IF_ERROR(norm(&l.input_norm));
    STRATA_RETURN_IF_ERROR(norm(&l.post_norm));
    STRATA_RETURN_IF_ERROR(matrix(qd, hs, &l.wq));
    STRATA_RETURN_IF_ERROR(matrix(kvd, hs, &l.wk));
    STRATA_RETURN_IF_ERROR(matrix(kvd, hs, &l.wv));
    STRATA_RETURN_IF_ERROR(matrix(hs, qd, &l.wo));
    STRATA_RETURN_IF_ERROR(matrix(ff, hs, &l.w_gate));
    STRATA_RETURN_IF_ERROR(matrix(ff, hs, &l.w_up));
    STRATA_RETURN_IF_ERROR(matrix(hs, ff, &l.w_down));
    m->layers_.push_back(l);
  }
  STRATA_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(st), "random weights"));
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
               kvd = size_t{c.num_kv_heads} * c.head_dim, ff = c.intermediate_size;
  const size_t wide = std::max({hs, qd, ff});
  auto s = std::make_unique<Scratch>();
  s->rows = rows;
  // One allocation, carved in 256-byte aligned pieces.
  std::vector<std::pair<void**, size_t>> pieces = {
      {reinterpret_cast<void**>(&s->ids), rows * 4},
      {reinterpret_cast<void**>(&s->positions), rows * 4},
      {reinterpret_cast<void**>(&s->next), rows * 4},
      {reinterpret_cast<void**>(&s->x), rows * hs * 4},
      {reinterpret_cast<void**>(&s->q), rows * qd * 4},
      {reinterpret_cast<void**>(&s->k), rows * kvd * 4},
      {reinterpret_cast<void**>(&s->v), rows * kvd * 4},
      {reinterpret_cast<void**>(&s->att), rows * qd * 4},
      {reinterpret_cast<void**>(&s->o), rows * hs * 4},
      {reinterpret_cast<void**>(&s->g), rows * ff * 4},
      {reinterpret_cast<void**>(&s->u), rows * ff * 4},
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
      *blas_,
      blas_->gemm_ex(Cublas(cublas_), CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, w, t, in, x,
                     t, in, &beta, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
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

absl::Status CudaLlamaModel::EnsureLogits(int out_rows) const {
  Scratch& s = *scratch_;
  if (s.logit_rows >= static_cast<uint32_t>(out_rows)) return absl::OkStatus();
  cudaFree(s.logits);
  s.logits = nullptr;
  s.logit_rows = 0;
  STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(&s.logits, size_t(out_rows) * config_.vocab_size * 4),
                                   absl::StrCat(out_rows, " rows of logits")));
  s.logit_rows = static_cast<uint32_t>(out_rows);
  return absl::OkStatus();
}

template <typename Attend>
absl::Status CudaLlamaModel::Forward(int n, int out_rows, const Attend& attend,
                                     std::vector<int32_t>* next, std::vector<float>* logits) const {
  STRATA_RETURN_IF_ERROR(EnsureLogits(out_rows));
  STRATA_RETURN_IF_ERROR(ForwardOnDevice(n, out_rows, attend));
  return Collect(out_rows, next, logits);
}

template <typename Attend>
absl::Status CudaLlamaModel::ForwardOnDevice(
    int n, int out_rows, const Attend& attend,
    const std::function<absl::Status(uint32_t)>* after_layer) const {
  const ModelConfig& c = config_;
  Scratch& s = *scratch_;
  cudaStream_t st = Stream(stream_);
  const bool bf16 = options_.weights == WeightType::kBf16;
  auto norm = bf16 ? Ops<__nv_bfloat16>::Norm : Ops<__half>::Norm;
  auto glu = bf16 ? Ops<__nv_bfloat16>::Glu : Ops<__half>::Glu;
  auto to_w = bf16 ? Ops<__nv_bfloat16>::ToWeightType : Ops<__half>::ToWeightType;
  const int hs = static_cast<int>(c.hidden_size), H = static_cast<int>(c.num_heads),
            KH = static_cast<int>(c.num_kv_heads), D = static_cast<int>(c.head_dim),
            ff = static_cast<int>(c.intermediate_size), vocab = static_cast<int>(c.vocab_size);
  const int qd = H * D, kvd = KH * D;
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
    STRATA_RETURN_IF_ERROR(attend(li));
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
    if (after_layer != nullptr && *after_layer) {
      STRATA_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(st), "layer"));
      STRATA_RETURN_IF_ERROR((*after_layer)(li));
    }
  }
  // The final norm and the vocabulary over the last out_rows rows; their greedy tokens.
  const int first = n - out_rows;
  STRATA_RETURN_IF_ERROR(
      norm(s.x + size_t(first) * hs, norm_, out_rows, hs, c.rms_norm_eps, s.h, st));
  STRATA_RETURN_IF_ERROR(Gemm(s.h, out_rows, hs, lm_head_, vocab, s.logits));
  return kc::ArgmaxRows(s.logits, out_rows, vocab, s.next, st);
}

absl::Status CudaLlamaModel::Collect(int out_rows, std::vector<int32_t>* next,
                                     std::vector<float>* logits) const {
  Scratch& s = *scratch_;
  cudaStream_t st = Stream(stream_);
  const int vocab = static_cast<int>(config_.vocab_size);
  next->resize(out_rows);
  STRATA_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(next->data(), s.next, out_rows * 4, cudaMemcpyDeviceToHost, st), "tokens"));
  if (logits != nullptr) {
    logits->resize(size_t(out_rows) * vocab);
    STRATA_RETURN_IF_ERROR(CudaError(
        cudaMemcpyAsync(logits->data(), s.logits, logits->size() * 4, cudaMemcpyDeviceToHost, st),
        "logits"));
  }
  return CudaError(cudaStreamSynchronize(st), "step");
}

namespace {

absl::Status CheckTokens(absl::Span<const uint32_t> tokens, uint32_t vocab) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("cuda model: token ", i, " is ", tokens[i],
                                                     ", beyond the vocabulary of ", vocab));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint32_t> CudaLlamaModel::Step(absl::Span<const uint32_t> tokens, DenseKv* kv,
                                              std::vector<float>* logits, bool every_row) const {
  const ModelConfig& c = config_;
  if (tokens.empty()) return absl::InvalidArgumentError("cuda model: a step of no tokens");
  if (kv == nullptr) return absl::InvalidArgumentError("cuda model: no KV cache");
  STRATA_RETURN_IF_ERROR(CheckTokens(tokens, c.vocab_size));
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
  std::vector<int32_t> ids(tokens.begin(), tokens.end()), pos(n);
  for (int i = 0; i < n; ++i) pos[i] = static_cast<int32_t>(kv->tokens_ + i);
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(s.ids, ids.data(), n * 4, cudaMemcpyHostToDevice, st), "tokens"));
  STRATA_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(s.positions, pos.data(), n * 4, cudaMemcpyHostToDevice, st), "positions"));
  const bool bf16 = options_.weights == WeightType::kBf16;
  STRATA_RETURN_IF_ERROR((bf16 ? Ops<__nv_bfloat16>::Embed : Ops<__half>::Embed)(
      embed_, s.ids, n, static_cast<int>(c.hidden_size), s.x, st));
  const int KH = static_cast<int>(c.num_kv_heads), D = static_cast<int>(c.head_dim);
  const size_t layer_kv = size_t{c.num_kv_heads} * kv->capacity_ * c.head_dim;
  auto attend = [&](uint32_t li) -> absl::Status {
    float* ck = kv->k_ + li * layer_kv;
    float* cv = kv->v_ + li * layer_kv;
    STRATA_RETURN_IF_ERROR(
        kc::WriteKv(s.k, s.v, s.positions, n, KH, D, static_cast<int>(kv->capacity_), ck, cv, st));
    return kc::DenseAttention({.q = s.q,
                               .k = ck,
                               .v = cv,
                               .positions = s.positions,
                               .out = s.att,
                               .rows = n,
                               .q_heads = static_cast<int>(c.num_heads),
                               .kv_heads = KH,
                               .head_dim = D,
                               .capacity = static_cast<int>(kv->capacity_),
                               .exact = options_.exact_attention},
                              st);
  };
  std::vector<int32_t> next;
  STRATA_RETURN_IF_ERROR(Forward(n, logits != nullptr && every_row ? n : 1, attend, &next, logits));
  kv->tokens_ += static_cast<uint32_t>(n);
  return static_cast<uint32_t>(next.back());
}

absl::StatusOr<std::vector<uint32_t>> CudaLlamaModel::DecodePaged(
    const PagedStep& p, std::vector<float>* logits) const {
  const ModelConfig& c = config_;
  const int n = static_cast<int>(p.tokens.size());
  if (n == 0) return absl::InvalidArgumentError("cuda model: a paged step of no sequences");
  if (p.positions.size() != p.tokens.size() || p.window_slots.size() != p.tokens.size() ||
      p.window_lens.size() != p.tokens.size() || p.block_tables.size() != c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda model: a paged step of ", n, " tokens needs as many positions (", p.positions.size(),
        "), window slots (", p.window_slots.size(), ") and lengths (", p.window_lens.size(),
        "), and a block table per layer (", p.block_tables.size(), " of ", c.num_layers, ")"));
  }
  STRATA_RETURN_IF_ERROR(CheckTokens(p.tokens, c.vocab_size));
  if (p.layout.kv_heads != static_cast<int>(c.num_kv_heads) ||
      p.layout.head_dim != static_cast<int>(c.head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: pages of ", p.layout.kv_heads, " KV heads of ", p.layout.head_dim,
                     " channels; the model has ", c.num_kv_heads, " of ", c.head_dim));
  }
  if (!p.layer_layouts.empty()) {
    if (p.layer_layouts.size() != c.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda model: ", p.layer_layouts.size(), " layer layouts for ", c.num_layers, " layers"));
    }
    // A layer's layout may differ from the pool's in its codebook fields alone: the split counts
    // (below) and the graph's key hold those, and nothing else of a layer's layout.
    for (const kc::PagedKvLayout& l : p.layer_layouts) {
      const kc::PagedKvLayout& P = p.layout;
      if (l.format != P.format || l.kv_heads != P.kv_heads || l.head_dim != P.head_dim ||
          l.page_tokens != P.page_tokens || l.key_bits != P.key_bits ||
          l.value_bits != P.value_bits || l.k_group != P.k_group || l.v_group != P.v_group ||
          l.key_codes != P.key_codes || l.key_scales != P.key_scales ||
          l.key_zeros != P.key_zeros || l.value_codes != P.value_codes ||
          l.value_scales != P.value_scales || l.value_zeros != P.value_zeros ||
          l.page_bytes != P.page_bytes) {
        return absl::InvalidArgumentError(
            "cuda model: a layer's layout differs from the step's pool in more than its codebook");
      }
    }
  }
  for (int b = 0; b < n; ++b) {
    if (p.window_slots[b] < 0 || p.window_slots[b] >= p.slots || p.window_lens[b] < 0 ||
        p.window_lens[b] >= p.max_window) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda model: sequence ", b, ": window slot ", p.window_slots[b], " of ", p.slots,
          ", length ", p.window_lens[b], " (the window holds ", p.max_window, ")"));
    }
  }
  STRATA_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "set device"));
  STRATA_RETURN_IF_ERROR(EnsureScratch(static_cast<uint32_t>(n)));
  Scratch& s = *scratch_;
  cudaStream_t st = Stream(stream_);
  const int H = static_cast<int>(c.num_heads), KH = static_cast<int>(c.num_kv_heads),
            D = static_cast<int>(c.head_dim);
  // The step's own buffers: window slots, lengths after the append, the kernel's workspace.
  kc::PagedDecodeArgs a;
  a.batch = n;
  a.q_heads = H;
  a.max_pages = p.max_pages;
  a.max_window = p.max_window;
  // Each layer's split count (a mix's codebook layers run another kernel than the pool's), the
  // workspace sized for the most.
  int splits = kc::ChooseSplits(p.layout, a, p.max_pages_in_batch);
  std::vector<int> layer_splits(c.num_layers, splits);
  for (size_t li = 0; li < p.layer_layouts.size(); ++li) {
    const kc::PagedKvLayout& l = p.layer_layouts[li];
    if (l.codebook_group == p.layout.codebook_group && l.codebook_bits == p.layout.codebook_bits) {
      continue;  // the pool's layout: the pool's count (every step, every layer: no query again)
    }
    layer_splits[li] = kc::ChooseSplits(l, a, p.max_pages_in_batch);
    splits = std::max(splits, layer_splits[li]);
  }
  const size_t work = kc::WorkspaceBytes(n, H, D, splits);
  const size_t need = 3 * size_t(n) * 4 + 256 + work;
  if (paged_bytes_ < need) {
    cudaFree(paged_);
    paged_ = nullptr;
    paged_bytes_ = 0;
    STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(&paged_, need), "paged step buffers"));
    paged_bytes_ = need;
  }
  int32_t* d_slots = static_cast<int32_t*>(paged_);
  int32_t* d_lens = d_slots + n;       // before the append
  int32_t* d_lens_after = d_lens + n;  // after it
  void* d_work = static_cast<uint8_t*>(paged_) + (3 * size_t(n) * 4 + 255) / 256 * 256;
  std::vector<int32_t> host(3 * size_t(n));
  for (int b = 0; b < n; ++b) {
    host[b] = p.window_slots[b];
    host[n + b] = p.window_lens[b];
    host[2 * n + b] = p.window_lens[b] + 1;
  }
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(d_slots, host.data(), host.size() * 4, cudaMemcpyHostToDevice, st),
                "window slots"));
  std::vector<int32_t> ids(p.tokens.begin(), p.tokens.end());
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(s.ids, ids.data(), n * 4, cudaMemcpyHostToDevice, st), "tokens"));
  STRATA_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(s.positions, p.positions.data(), n * 4, cudaMemcpyHostToDevice, st),
                "positions"));
  const bool bf16 = options_.weights == WeightType::kBf16;
  const size_t layer_window = size_t(p.slots) * KH * p.max_window * D;
  a.page_counts = p.page_counts;
  a.pages = p.pages;
  a.page_descs = p.page_descs;
  a.page_desc_ids = p.page_desc_ids;
  a.constants = p.constants;
  a.window_lens = d_lens_after;
  a.window_slots = d_slots;
  a.q = s.q;
  a.out = s.att;
  a.splits = splits;
  a.workspace = d_work;
  auto attend = [&](uint32_t li) -> absl::Status {
    __half* wk = p.window_k + li * layer_window;
    __half* wv = p.window_v + li * layer_window;
    STRATA_RETURN_IF_ERROR(
        kc::AppendWindow(s.k, s.v, d_slots, d_lens, n, KH, D, p.max_window, wk, wv, st));
    if (p.save_kv != nullptr) {
      const size_t rows_kv = size_t(n) * KH * D;
      float* dst = p.save_kv + size_t(li) * 2 * rows_kv;
      STRATA_RETURN_IF_ERROR(CudaError(
          cudaMemcpyAsync(dst, s.k, rows_kv * 4, cudaMemcpyDeviceToDevice, st), "save K"));
      STRATA_RETURN_IF_ERROR(
          CudaError(cudaMemcpyAsync(dst + rows_kv, s.v, rows_kv * 4, cudaMemcpyDeviceToDevice, st),
                    "save V"));
    }
    kc::PagedDecodeArgs la = a;
    la.block_table = p.block_tables[li];
    la.splits = layer_splits[li];
    la.window_k = wk;
    la.window_v = wv;
    return kc::PagedDecode(p.layer_layouts.empty() ? p.layout : p.layer_layouts[li], la,
                           p.max_pages_in_batch, st);
  };
  const int out_rows = p.last_row_only ? 1 : n;
  auto on_device = [&]() -> absl::Status {
    STRATA_RETURN_IF_ERROR((bf16 ? Ops<__nv_bfloat16>::Embed : Ops<__half>::Embed)(
        embed_, s.ids, n, static_cast<int>(c.hidden_size), s.x, st));
    return ForwardOnDevice(n, out_rows, attend, &p.after_layer);
  };
  STRATA_RETURN_IF_ERROR(EnsureLogits(out_rows));
  if (!options_.cuda_graphs || !p.graph || p.after_layer) {
    STRATA_RETURN_IF_ERROR(on_device());
  } else {
    // What the captured kernels hold: the shapes and every buffer's address.
    std::vector<uint64_t> key = {uint64_t(n),
                                 uint64_t(out_rows),
                                 reinterpret_cast<uint64_t>(p.save_kv),
                                 uint64_t(splits),
                                 uint64_t(p.max_pages_in_batch),
                                 uint64_t(p.max_pages),
                                 uint64_t(p.slots),
                                 uint64_t(p.max_window),
                                 reinterpret_cast<uint64_t>(p.pages),
                                 reinterpret_cast<uint64_t>(p.page_descs),
                                 reinterpret_cast<uint64_t>(p.page_desc_ids),
                                 reinterpret_cast<uint64_t>(p.constants),
                                 reinterpret_cast<uint64_t>(p.page_counts),
                                 reinterpret_cast<uint64_t>(p.window_k),
                                 reinterpret_cast<uint64_t>(p.window_v),
                                 reinterpret_cast<uint64_t>(paged_),
                                 reinterpret_cast<uint64_t>(s.block),
                                 uint64_t(s.rows),
                                 reinterpret_cast<uint64_t>(s.logits),
                                 uint64_t(s.logit_rows),
                                 uint64_t(p.layout.format),
                                 uint64_t(p.layout.page_tokens),
                                 uint64_t(p.layout.key_bits),
                                 uint64_t(p.layout.value_bits),
                                 uint64_t(p.layout.k_group),
                                 uint64_t(p.layout.v_group),
                                 uint64_t(p.layout.key_codes),
                                 uint64_t(p.layout.key_scales),
                                 uint64_t(p.layout.key_zeros),
                                 uint64_t(p.layout.value_codes),
                                 uint64_t(p.layout.value_scales),
                                 uint64_t(p.layout.value_zeros),
                                 uint64_t(p.layout.page_bytes),
                                 uint64_t(p.layout.codebook_group),
                                 uint64_t(p.layout.codebook_bits)};
    for (const int32_t* t : p.block_tables) key.push_back(reinterpret_cast<uint64_t>(t));
    for (const int s : layer_splits) key.push_back(uint64_t(s));
    for (const kc::PagedKvLayout& l : p.layer_layouts) {  // which layers take the codebook kernel
      key.push_back(uint64_t(l.codebook_group) << 8 | uint64_t(l.codebook_bits));
    }
    if (graph_ == nullptr || key != graph_key_) {
      if (graph_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_));
      graph_ = nullptr;
      graph_key_.clear();
      STRATA_RETURN_IF_ERROR(CudaError(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal),
                                       "begin graph capture"));
      const absl::Status captured = on_device();
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(st, &graph);
      if (!captured.ok() || ended != cudaSuccess) {
        if (graph != nullptr) cudaGraphDestroy(graph);
        cudaGetLastError();  // the capture's error is reported here, not left for the next call
        if (!captured.ok()) return captured;
        return CudaError(ended, "graph capture of the decode step");
      }
      cudaGraphExec_t exec = nullptr;
      const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      STRATA_RETURN_IF_ERROR(CudaError(made, "instantiate the decode step's graph"));
      graph_ = exec;
      graph_key_ = std::move(key);
      ++graph_captures_;
    } else {
      ++graph_replays_;
    }
    STRATA_RETURN_IF_ERROR(
        CudaError(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_), st), "decode step graph"));
  }
  std::vector<int32_t> next;
  STRATA_RETURN_IF_ERROR(Collect(out_rows, &next, logits));
  return std::vector<uint32_t>(next.begin(), next.end());
}

}  // namespace strata::model::cuda
