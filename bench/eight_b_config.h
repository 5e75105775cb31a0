// The shape of an 8B Llama-family model (Llama 3 8B: 32 layers, hidden 4096, 32 query heads over
// 8 KV heads, head dim 128, SwiGLU 14336, vocabulary 128256), for the GPU benchmarks' random
// models.
#pragma once

#include "model/config.h"

namespace strata::bench {

inline model::ModelConfig EightBConfig() {
  model::ModelConfig c;
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 131072;
  c.rope_theta = 500000;
  c.rms_norm_eps = 1e-5;
  c.torch_dtype = "bfloat16";
  c.bos_token_id = 128000;
  c.eos_token_id = 128001;
  return c;
}

}  // namespace strata::bench
