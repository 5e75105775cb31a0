#include "tools/model_commands.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/calibration.h"
#include "kernels/codec.h"
#include "kernels/codec_spec.h"
#include "model/calibration_search.h"
#include "model/compute_backend.h"
#include "model/config.h"
#include "model/cpu_backend.h"
#include "model/kv_cache.h"
#include "model/kv_evaluation.h"
#ifdef STRATA_WITH_CUDA_MODEL
#include "model/cuda/cuda_backend.h"
#include "model/cuda/cuda_llama.h"
#endif
#include "model/llama.h"
#include "model/safetensors.h"
#include "model/sampler.h"
#include "model/text_stream.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/progress.h"

namespace strata::tools {
namespace {

struct Loaded {
  std::unique_ptr<model::LlamaModel> model;
  std::unique_ptr<model::Tokenizer> tokenizer;
};

absl::StatusOr<Loaded> Load(const ModelCommandOptions& o) {
  Loaded l;
  STRATA_ASSIGN_OR_RETURN(l.model, model::LlamaModel::Load(o.model_dir));
  STRATA_ASSIGN_OR_RETURN(l.tokenizer, model::Tokenizer::Load(o.model_dir));
  return l;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<uint32_t> WithBos(const model::ModelConfig& c, std::vector<uint32_t> ids) {
  if (c.bos_token_id >= 0 && (ids.empty() || ids[0] != c.bos_token_id)) {
    ids.insert(ids.begin(), static_cast<uint32_t>(c.bos_token_id));
  }
  return ids;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// The KV cache these options ask for.
model::KvCacheOptions CacheOptions(const ModelCommandOptions& o) {
  return {.codec = o.codec,
          .chunk_tokens = o.chunk_tokens,
          .window_tokens = o.window_tokens,
          .calibration = o.calibration};
}

// The backend ppl and eval compute on: the CPU's over the loaded model, or the CUDA backend on
// `device` (weights uploaded from it, bf16 as served; one sequence at a time, which may add
// `step_tokens` tokens in one step). A CUDA backend serves one block format: one per codec.
absl::StatusOr<std::unique_ptr<model::ComputeBackend>> BackendFor(const Loaded& l,
                                                                  const model::Device& device,
                                                                  uint32_t step_tokens) {
  if (device.kind == model::Device::Kind::kCpu) {
    return std::make_unique<model::CpuBackend>(l.model.get());
  }
#ifdef STRATA_WITH_CUDA_MODEL
  return model::cuda::MakeCudaBackend(
      *l.model, {.device = device.index, .max_sequences = 1, .max_step_tokens = step_tokens});
#else
  (void)step_tokens;
  return absl::UnimplementedError(
      absl::StrCat("--device ", device.ToString(), ": this build of strata has no CUDA"));
#endif
}

// calibrate and dump-kv read the model's full-precision K and V on the CPU.
absl::Status CpuOnly(const ModelCommandOptions& o, absl::string_view command) {
  if (o.device == "cpu") return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(command, " runs on the CPU (--device ", o.device,
                                                 " is for generate, ppl and eval)"));
}

}  // namespace

namespace {

model::Sampler SamplerFor(const GenerateOptions& o) {
  return model::Sampler({.temperature = o.temperature,
                         .top_k = o.top_k,
                         .top_p = o.top_p,
                         .seed = o.seed,
                         .min_p = o.min_p,
                         .presence_penalty = o.presence_penalty,
                         .frequency_penalty = o.frequency_penalty,
                         .repetition_penalty = o.repetition_penalty});
}

// generate --device cuda:N: the CUDA model (model/cuda/) with its full-precision KV on the device.
absl::Status RunGenerateOnGpu(const GenerateOptions& o, const model::Device& device,
                              std::ostream& out, std::ostream& info) {
#ifdef STRATA_WITH_CUDA_MODEL
  if (o.codec != "fp16" || o.window_tokens != 0) {
    return absl::UnimplementedError(absl::StrCat("generate --device ", device.ToString(),
                                                 ": the GPU path keeps the KV cache at full "
                                                 "precision on the device; --codec ",
                                                 o.codec, " runs with --device cpu for now"));
  }
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig c = l.model->config();  // a copy: the host model is released below
  const std::vector<uint32_t> prompt = WithBos(c, l.tokenizer->Encode(o.prompt));
  const auto tu = std::chrono::steady_clock::now();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::cuda::CudaLlamaModel> gpu,
                          model::cuda::CudaLlamaModel::Upload(*l.model, {.device = device.index}));
  const double upload_s = Seconds(tu);
  l.model.reset();  // the host's copy of the weights is not needed any more
  STRATA_ASSIGN_OR_RETURN(auto kv, gpu->NewKv(static_cast<uint32_t>(prompt.size()) + o.max_tokens));
  const model::Sampler sampler = SamplerFor(o);
  STRATA_RETURN_IF_ERROR(sampler.options().Validate());
  const bool greedy = o.temperature == 0 && o.presence_penalty == 0 && o.frequency_penalty == 0 &&
                      o.repetition_penalty == 1;
  std::vector<float> logits;
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_ASSIGN_OR_RETURN(uint32_t next, gpu->Step(prompt, kv.get(), greedy ? nullptr : &logits,
                                                   /*every_row=*/false));
  const double prefill_s = Seconds(t0);
  std::vector<uint32_t> generated;
  model::TextStream text(l.tokenizer.get(), {});
  out << o.prompt;
  const auto t1 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < o.max_tokens; ++i) {
    if (!greedy) {  // the sampler on the host, over the last token's logits
      next = sampler.Sample(absl::MakeConstSpan(logits).subspan(logits.size() - c.vocab_size), i,
                            prompt, generated);
    }
    if (c.eos_token_id >= 0 && next == static_cast<uint32_t>(c.eos_token_id)) break;
    generated.push_back(next);
    STRATA_ASSIGN_OR_RETURN(model::TextStream::Piece piece, text.Add(next));
    out << piece.text << std::flush;
    if (i + 1 == o.max_tokens) break;
    STRATA_ASSIGN_OR_RETURN(
        next, gpu->Step({&generated.back(), 1}, kv.get(), greedy ? nullptr : &logits));
  }
  out << text.Finish() << "\n";
  const double decode_s = Seconds(t1);
  info << absl::StrFormat(
      "[%s: weights %.2f GiB uploaded in %.2f s; %d prompt tokens in %.3f s (%.1f tok/s), %d "
      "generated in %.3f s (%.1f tok/s); KV at fp32 on the device, %d tokens]\n",
      device.ToString(), gpu->weight_bytes() / double(1 << 30), upload_s, prompt.size(), prefill_s,
      prompt.size() / prefill_s, generated.size(), decode_s,
      generated.size() / std::max(decode_s, 1e-9), kv->tokens());
  return absl::OkStatus();
#else
  (void)o;
  (void)out;
  (void)info;
  return absl::UnimplementedError(
      absl::StrCat("generate --device ", device.ToString(), ": this build of strata has no CUDA"));
#endif
}

}  // namespace

absl::Status RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& info) {
  STRATA_ASSIGN_OR_RETURN(const model::Device device, model::ParseDevice(o.device));
  if (device.kind == model::Device::Kind::kCuda) return RunGenerateOnGpu(o, device, out, info);
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  const std::vector<uint32_t> prompt = WithBos(c, l.tokenizer->Encode(o.prompt));
  STRATA_ASSIGN_OR_RETURN(auto cache,
                          l.model->NewCache({.codec = o.codec,
                                             .chunk_tokens = o.chunk_tokens,
                                             .window_tokens = o.window_tokens,
                                             .calibration = o.calibration}));
  const auto t0 = std::chrono::steady_clock::now();
  // Serving's chunk-aligned prefill (LlamaModel::Prefill), so that the output is the cluster's
  // for the same codec; a cache with a full-precision window (--kv_window) prefills in one step.
  STRATA_ASSIGN_OR_RETURN(std::vector<float> logits,
                          o.window_tokens == 0 ? l.model->Prefill(prompt, cache.get())
                                               : l.model->Step(prompt, cache.get()));
  const double prefill_s = Seconds(t0);
  const model::Sampler sampler = SamplerFor(o);
  STRATA_RETURN_IF_ERROR(sampler.options().Validate());
  std::vector<uint32_t> generated;
  // What a client of the HTTP API sees: well-formed UTF-8, a character split across tokens
  // printed once whole, bytes that form none shown as U+FFFD.
  model::TextStream text(l.tokenizer.get(), {});
  out << o.prompt;
  const auto t1 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < o.max_tokens; ++i) {
    const uint32_t next = sampler.Sample(
        absl::MakeConstSpan(logits).subspan(logits.size() - c.vocab_size), i, prompt, generated);
    if (c.eos_token_id >= 0 && next == c.eos_token_id) break;
    generated.push_back(next);
    STRATA_ASSIGN_OR_RETURN(model::TextStream::Piece piece, text.Add(next));
    out << piece.text << std::flush;
    if (i + 1 == o.max_tokens) break;  // the last token's logits are never used
    STRATA_ASSIGN_OR_RETURN(logits, l.model->Step({&next, 1}, cache.get()));
  }
  out << text.Finish() << "\n";
  const double decode_s = Seconds(t1);
  info << absl::StrFormat(
      "[%d prompt tokens in %.3f s (%.1f tok/s), %d generated in %.3f s (%.1f tok/s); KV cache %s: "
      "%d blocks of %d tokens per layer (%d bytes) + %d-token window]\n",
      prompt.size(), prefill_s, prompt.size() / prefill_s, generated.size(), decode_s,
      generated.size() / std::max(decode_s, 1e-9), o.codec, cache->blocks_per_layer(),
      o.chunk_tokens, cache->block_bytes(), cache->window_tokens());
  return absl::OkStatus();
}

absl::Status RunPpl(const PplOptions& o, std::ostream& out) {
  STRATA_ASSIGN_OR_RETURN(const model::Device device, model::ParseDevice(o.device));
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  const std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::ComputeBackend> backend,
                          BackendFor(l, device, o.chunk_tokens));
  STRATA_ASSIGN_OR_RETURN(
      model::PerplexityResult r,
      model::Perplexity(*backend, ids, CacheOptions(o), o.context, o.max_windows));
  out << absl::StrFormat(
      "perplexity %.4f over %d tokens (%d windows of up to %d) with KV codec %s at %.3f bits "
      "per element (%d-token chunks, all metadata counted); %.1f s on %s\n",
      r.ppl, r.scored, r.windows, o.context, o.codec, r.bits(), o.chunk_tokens, r.seconds,
      device.ToString());
  return absl::OkStatus();
}

absl::Status RunCalibrate(const CalibrateOptions& o, std::ostream& out) {
  STRATA_RETURN_IF_ERROR(CpuOnly(o, "calibrate"));
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  const std::vector<uint32_t> ids = WithBos(l.model->config(), l.tokenizer->Encode(text, false));
  std::unique_ptr<Progress> bar;  // one per search stage
  std::string stage;
  const model::CalibrationSearchOptions so{
      .chunk_tokens = o.chunk_tokens,
      .window_tokens = o.window_tokens,
      .context = o.context,
      .windows = o.windows,
      .error_queries = o.error_queries,
      .cq_attention_weights = o.cq_attention_weights,
      .cq_query_metric = o.cq_query_metric,
      .cq_output_metric = o.cq_output_metric,
      .source = o.source.empty() ? o.text_file : o.source,
      .progress = [&](absl::string_view s, uint32_t done, uint32_t total) {
        if (bar == nullptr || s != stage) {
          if (bar != nullptr) bar->Done();
          stage = std::string(s);
          bar = std::make_unique<Progress>(absl::StrCat("calibrate: ", s), total);
        }
        bar->Advance(1, absl::StrCat("layer ", done - 1));
      }};
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_ASSIGN_OR_RETURN(kernels::Calibration cal,
                          model::SearchCalibration(*l.model, ids, o.codec, so));
  bar.reset();
  STRATA_RETURN_IF_ERROR(cal.Save(o.out_file));
  out << absl::StrFormat("wrote %s: calibration %016x of %s for %s (%d layers; %s); %.1f s\n",
                         o.out_file, cal.fingerprint(), cal.codec, o.model_dir, cal.layers.size(),
                         cal.source, Seconds(t0));
  for (size_t i = 0; i < cal.layers.size(); ++i) {
    out << absl::StrFormat("  layer %d: clip K %.2f V %.2f\n", i, cal.layers[i].k_clip,
                           cal.layers[i].v_clip);
  }
  return absl::OkStatus();
}

namespace {

// Greedy continuation of each prompt with the given cache codec: the prompt in one step (its
// tokens attend to each other at full precision), then a token a step.
absl::StatusOr<std::vector<std::vector<uint32_t>>> Continue(
    const model::ComputeBackend& backend, const std::vector<std::vector<uint32_t>>& prompts,
    const model::KvCacheOptions& opts, uint32_t n) {
  const model::ModelConfig& c = backend.config();
  std::vector<std::vector<uint32_t>> out;
  for (const std::vector<uint32_t>& p : prompts) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::KvCache> cache, backend.NewCache(opts));
    model::KvCache* const caches[] = {cache.get()};
    const absl::Span<const uint32_t> prompt[] = {p};
    STRATA_ASSIGN_OR_RETURN(std::vector<std::vector<float>> step,
                            backend.StepBatch(prompt, caches));
    std::vector<float> logits = std::move(step[0]);
    std::vector<uint32_t> gen;
    for (uint32_t i = 0; i < n; ++i) {
      const float* last = &logits[logits.size() - c.vocab_size];
      const uint32_t next =
          static_cast<uint32_t>(std::max_element(last, last + c.vocab_size) - last);
      gen.push_back(next);
      if (i + 1 == n) break;
      const absl::Span<const uint32_t> one[] = {{&next, 1}};
      STRATA_ASSIGN_OR_RETURN(step, backend.StepBatch(one, caches));
      logits = std::move(step[0]);
    }
    out.push_back(std::move(gen));
  }
  return out;
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

double Max(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

}  // namespace

absl::Status RunEval(const EvalOptions& o, std::ostream& out) {
  if (o.codecs.empty()) return absl::InvalidArgumentError("eval: --codecs names no codec");
  for (const std::string& spec : o.codecs) {
    STRATA_RETURN_IF_ERROR(kernels::CodecSpec::Parse(spec).status());
  }
  STRATA_ASSIGN_OR_RETURN(const model::Device device, model::ParseDevice(o.device));
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  const std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  // A step holds a whole continuation prompt, or a chunk of a perplexity window.
  const uint32_t step_tokens = std::max(o.prompt_tokens + 1, o.chunk_tokens);
  if (ids.size() < size_t{o.prompt_tokens} + o.generate_tokens + 2 || ids.size() < o.context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval: the text has ", ids.size(), " tokens; it needs at least --context (", o.context,
        ") and a prompt + continuation (", o.prompt_tokens + o.generate_tokens, ")"));
  }
  if (o.error_queries < 1 || o.error_queries >= o.context) {
    return absl::InvalidArgumentError("eval: error queries must be in [1, context)");
  }
  // The error window: the text's first `context` tokens, run once at full precision.
  std::vector<model::LayerKv> kv;
  const std::vector<uint32_t> window(ids.begin(), ids.begin() + o.context);
  STRATA_RETURN_IF_ERROR(l.model->Forward(window, &kv).status());
  // Continuation prompts spread over the text, each starting with BOS.
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < o.continuations; ++i) {
    const size_t span = ids.size() - o.prompt_tokens - o.generate_tokens;
    const size_t start = span * i / std::max<uint32_t>(1, o.continuations);
    std::vector<uint32_t> p(ids.begin() + start, ids.begin() + start + o.prompt_tokens);
    prompts.push_back(WithBos(c, std::move(p)));
  }
  model::KvCacheOptions base_opts{.codec = "fp16", .chunk_tokens = o.chunk_tokens,
                                  .window_tokens = o.window_tokens};
  // The fp16 baseline on the device the codecs run on; a CUDA backend per codec (one block
  // format each), made as its codec's turn comes and released after it.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::ComputeBackend> backend,
                          BackendFor(l, device, step_tokens));
  STRATA_ASSIGN_OR_RETURN(auto baseline_gen,
                          Continue(*backend, prompts, base_opts, o.generate_tokens));
  model::KvCacheOptions fp16 = CacheOptions(o);
  fp16.codec = "fp16";
  // KL to fp16 over the first two windows (the reference log-probabilities are vocab-sized).
  const size_t kl_tokens = 2 * size_t{o.context};
  std::vector<float> reference;
  STRATA_ASSIGN_OR_RETURN(
      model::PerplexityResult base,
      model::Perplexity(*backend, ids, fp16, o.context, o.max_windows, kl_tokens, &reference));
  backend.reset();

  nlohmann::json report = {{"model", o.model_dir},
                           {"text", o.text_file},
                           {"context", o.context},
                           {"windows", base.windows},
                           {"kl_tokens", std::min(kl_tokens, base.scored)},
                           {"scored_tokens", base.scored},
                           {"chunk_tokens", o.chunk_tokens},
                           {"window_tokens", o.window_tokens},
                           {"continuations", o.continuations},
                           {"prompt_tokens", o.prompt_tokens},
                           {"generate_tokens", o.generate_tokens},
                           {"fp16_perplexity", base.ppl},
                           {"device", device.ToString()},
                           {"codecs", nlohmann::json::array()}};
  out << absl::StrFormat(
      "model %s, text %s: perplexity over %d tokens (%d windows of %d), errors on the first %d "
      "tokens (last %d queries), %d greedy continuations of %d tokens after %d-token prompts; "
      "%d-token chunks, full-precision window >= %d\n",
      o.model_dir, o.text_file, base.scored, base.windows, o.context, o.context, o.error_queries,
      o.continuations, o.generate_tokens, o.prompt_tokens, o.chunk_tokens, o.window_tokens);
  // greedy: free-running agreement over the continuations, "+-" its standard error over them;
  // top1: teacher-forced, one position at a time over the KL tokens.
  out << absl::StrFormat("%-32s %6s %9s %8s %8s %8s %8s %8s %8s %8s %7s %5s %6s %7s %8s\n", "codec",
                         "bits", "ppl", "d ppl %", "KL nats", "K err", "K worst", "V err",
                         "V worst", "attn err", "greedy", "+-", "top1", "prefix", "enc MB/s")
      << std::flush;
  // Each codec's row is printed (and flushed) as it finishes; stderr shows how far it got.
  Progress progress("eval", o.codecs.size());
  std::map<std::string, std::vector<std::string>> layer_choices;
  std::vector<uint32_t> calib_ids;
  if (!o.calib_text_file.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string calib_text, ReadText(o.calib_text_file));
    calib_ids = WithBos(c, l.tokenizer->Encode(calib_text, false));
  }
  for (const std::string& spec : o.codecs) {
    ModelCommandOptions mo = o;
    mo.codec = spec;
    const kernels::CodecSpec parsed = *kernels::CodecSpec::Parse(spec);
    if (parsed.needs_calibration() || (parsed.searches_layers() && !calib_ids.empty())) {
      if (calib_ids.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "eval: codec ", spec, " needs calibration; give --calib_text (text disjoint from ",
            o.text_file, ")"));
      }
      model::CalibrationSearchOptions co;
      co.context = std::min<uint32_t>(o.context, static_cast<uint32_t>(calib_ids.size()));
      co.windows = 2;
      co.chunk_tokens = o.chunk_tokens;
      co.error_queries = o.error_queries;
      co.cq_attention_weights = o.cq_attention_weights;
      co.cq_query_metric = o.cq_query_metric;
      co.cq_output_metric = o.cq_output_metric;
      co.source = o.calib_text_file;
      absl::StatusOr<kernels::Calibration> cal =
          model::SearchCalibration(*l.model, calib_ids, spec, co);
      if (!cal.ok()) {  // e.g. a budget no per-layer choice fits: say so, go on
        out << absl::StrFormat("%-32s %s\n", spec, cal.status().ToString()) << std::flush;
        report["codecs"].push_back({{"codec", spec}, {"error", cal.status().ToString()}});
        progress.Advance(1, spec);
        continue;
      }
      mo.calibration = std::make_shared<kernels::Calibration>(*std::move(cal));
      if (parsed.searches_layers()) {  // the per-layer choice, for the reader and the JSON
        std::vector<std::string> chosen;
        for (const kernels::LayerCalibration& lc : mo.calibration->layers) chosen.push_back(lc.spec);
        layer_choices[spec] = chosen;
        out << absl::StrFormat("%-32s layers: %s\n", spec, absl::StrJoin(chosen, " | "));
      }
    }
    STRATA_ASSIGN_OR_RETURN(auto codec, kernels::Codec::Create(spec, mo.calibration));
    STRATA_ASSIGN_OR_RETURN(backend, BackendFor(l, device, step_tokens));
    absl::StatusOr<model::PerplexityResult> r = model::Perplexity(
        *backend, ids, CacheOptions(mo), o.context, o.max_windows, kl_tokens, nullptr, &reference);
    if (!r.ok() && device.kind != model::Device::Kind::kCpu &&
        r.status().code() == absl::StatusCode::kUnimplemented) {
      // A codec the GPU path does not take yet: say so, go on with the others.
      out << absl::StrFormat("%-32s %s\n", spec, r.status().ToString()) << std::flush;
      report["codecs"].push_back({{"codec", spec}, {"error", r.status().ToString()}});
      progress.Advance(1, spec);
      continue;
    }
    if (!r.ok()) return r.status();
    STRATA_ASSIGN_OR_RETURN(model::LayerErrors e,
                            model::MeasureLayerErrors(c, kv, o.context, *codec, o.chunk_tokens,
                                                      o.error_queries));
    model::KvCacheOptions opts = base_opts;
    opts.codec = spec;
    opts.calibration = mo.calibration;
    STRATA_ASSIGN_OR_RETURN(auto gen, Continue(*backend, prompts, opts, o.generate_tokens));
    backend.reset();
    double same = 0, prefix = 0;
    std::vector<double> per_continuation;  // each continuation's share of tokens as fp16's
    for (size_t i = 0; i < gen.size(); ++i) {
      size_t p = 0;
      while (p < gen[i].size() && gen[i][p] == baseline_gen[i][p]) ++p;
      prefix += p;
      double same_i = 0;
      for (size_t t = 0; t < gen[i].size(); ++t) same_i += gen[i][t] == baseline_gen[i][t];
      same += same_i;
      per_continuation.push_back(o.generate_tokens > 0 ? same_i / o.generate_tokens : 1.0);
    }
    const double total = static_cast<double>(gen.size()) * o.generate_tokens;
    const double agreement = total > 0 ? same / total : 1.0;
    // The agreement's standard error over continuations (they, not tokens, are the independent
    // draws: a continuation that parts from fp16 early loses most of its tokens at once).
    double var = 0;
    for (double a : per_continuation) var += (a - agreement) * (a - agreement);
    const double agreement_stderr =
        per_continuation.size() > 1
            ? std::sqrt(var / (per_continuation.size() - 1) / per_continuation.size())
            : 0.0;
    const double mean_prefix = gen.empty() ? 0 : prefix / gen.size();
    const double mbps = e.encode_seconds > 0 ? e.encoded_bytes_in / e.encode_seconds / 1e6 : 0;
    const double dppl = 100.0 * (r->ppl / base.ppl - 1.0);
    out << absl::StrFormat(
               "%-32s %6.3f %9.3f %+8.2f %8.5f %8.4f %8.4f %8.4f %8.4f %8.4f %6.1f%% %5.1f "
               "%5.1f%% %7.1f %8.1f\n",
               spec, r->bits(), r->ppl, dppl, r->kl, Mean(e.k), Max(e.k), Mean(e.v), Max(e.v),
               Mean(e.attn), 100 * agreement, 100 * agreement_stderr, 100 * r->top1, mean_prefix,
               mbps)
        << std::flush;
    progress.Advance(1, spec);
    report["codecs"].push_back(
        {{"codec", spec},
         {"bits_per_element", r->bits()},
         {"perplexity", r->ppl},
         {"perplexity_change_percent", dppl},
         {"kl_to_fp16_nats", r->kl},
         {"k_rel_error", {{"per_layer", e.k}, {"mean", Mean(e.k)}, {"worst", Max(e.k)}}},
         {"v_rel_error", {{"per_layer", e.v}, {"mean", Mean(e.v)}, {"worst", Max(e.v)}}},
         {"attn_rel_error",
          {{"per_layer", e.attn}, {"mean", Mean(e.attn)}, {"worst", Max(e.attn)}}},
         {"greedy_agreement", agreement},
         {"greedy_agreement_stderr", agreement_stderr},
         {"greedy_agreement_per_continuation", per_continuation},
         {"greedy_common_prefix_tokens", mean_prefix},
         {"top1_agreement_teacher_forced", r->top1},
         {"encode_mb_per_s_one_thread", mbps}});
    if (auto lc = layer_choices.find(spec); lc != layer_choices.end()) {
      report["codecs"].back()["layer_codecs"] = lc->second;
    }
  }
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out);
    f << report.dump(1) << "\n";
    if (!f) return absl::InternalError(absl::StrCat("eval: cannot write ", o.json_out));
    out << "wrote " << o.json_out << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunKvStructure(const KvStructureOptions& o, std::ostream& out) {
  STRATA_RETURN_IF_ERROR(CpuOnly(o, "kv-structure"));
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  if (ids.size() > o.context) ids.resize(o.context);
  std::vector<model::LayerKv> kv;
  STRATA_RETURN_IF_ERROR(l.model->Forward(ids, &kv).status());
  STRATA_ASSIGN_OR_RETURN(
      model::KvStructure st,
      model::MeasureKvStructure(c, kv, static_cast<uint32_t>(ids.size()),
                                std::min<uint32_t>(16, static_cast<uint32_t>(ids.size()) - 1)));
  out << absl::StrFormat(
      "model %s, text %s: %d tokens; per layer, the largest channel's max |x| over the median "
      "channel's (K, V), the same after the rotation stage, and the mean attention weight on the "
      "first token (queries from token 16 on)\n",
      o.model_dir, o.text_file, st.tokens);
  out << absl::StrFormat("%5s %9s %9s %9s %9s %11s %12s\n", "layer", "K spread", "K rot",
                         "V spread", "V rot", "first-token", "K top (h,c)");
  nlohmann::json layers = nlohmann::json::array();
  for (size_t li = 0; li < st.layers.size(); ++li) {
    const model::KvStructure::Layer& x = st.layers[li];
    out << absl::StrFormat("%5d %9.2f %9.2f %9.2f %9.2f %11.4f %8d,%-3d\n", li, x.k_spread,
                           x.k_spread_rotated, x.v_spread, x.v_spread_rotated, x.first_token_mass,
                           x.k_top_channel / c.head_dim, x.k_top_channel % c.head_dim);
    layers.push_back({{"layer", li},
                      {"k_spread", x.k_spread},
                      {"k_spread_rotated", x.k_spread_rotated},
                      {"v_spread", x.v_spread},
                      {"v_spread_rotated", x.v_spread_rotated},
                      {"first_token_mass", x.first_token_mass},
                      {"k_top_head", x.k_top_channel / c.head_dim},
                      {"k_top_channel", x.k_top_channel % c.head_dim}});
  }
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out);
    f << nlohmann::json{{"model", o.model_dir},
                        {"text", o.text_file},
                        {"tokens", st.tokens},
                        {"layers", layers}}
             .dump(1)
      << "\n";
    if (!f) return absl::InternalError(absl::StrCat("kv-structure: cannot write ", o.json_out));
    out << "wrote " << o.json_out << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunDumpKv(const DumpKvOptions& o, std::ostream& out) {
  STRATA_RETURN_IF_ERROR(CpuOnly(o, "dump-kv"));
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(o));
  const model::ModelConfig& c = l.model->config();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_file));
  std::vector<uint32_t> ids = WithBos(c, l.tokenizer->Encode(text, false));
  if (ids.size() > o.max_tokens) ids.resize(o.max_tokens);
  std::vector<model::LayerKv> kv;
  STRATA_RETURN_IF_ERROR(l.model->Forward(ids, &kv).status());
  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  std::vector<model::TensorToWrite> tensors;
  const int64_t t = static_cast<int64_t>(ids.size());
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  tensors.push_back(
      {"token_ids",
       model::TensorDType::kI32,
       {t},
       absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(ids32.data()), ids32.size() * 4)});
  for (uint32_t i = 0; i < kv.size(); ++i) {
    for (const auto& [name, v] : {std::pair{"k", &kv[i].k}, std::pair{"v", &kv[i].v}}) {
      tensors.push_back(
          {absl::StrCat("layers.", i, ".", name),
           model::TensorDType::kF32,
           {t, c.num_kv_heads, c.head_dim},
           absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v->data()), v->size() * 4)});
    }
  }
  const std::string path = o.out_dir + "/kv.safetensors";
  STRATA_RETURN_IF_ERROR(model::WriteSafetensors(path, tensors));
  out << absl::StrFormat(
      "wrote %s: %d tokens, %d layers of K (after RoPE) and V, [%d, %d, %d] "
      "fp32 each\n",
      path, t, kv.size(), t, c.num_kv_heads, c.head_dim);
  return absl::OkStatus();
}

}  // namespace strata::tools
