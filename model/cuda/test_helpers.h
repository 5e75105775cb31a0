// What model_cuda_test's files share: the checkout's paths and deterministic prompts.
// STRATA_SOURCE_DIR is the test binary's compile definition.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/config.h"

namespace strata::model::cuda::testing_helpers {

// The checkout: $STRATA_SOURCE_DIR where the binary runs away from its build (a lent GPU machine,
// scripts/gpu_bundle.sh), else where it was built.
inline std::string Dir(const char* rel) {
  const char* env = std::getenv("STRATA_SOURCE_DIR");
  return absl::StrCat(env != nullptr && *env != '\0' ? env : STRATA_SOURCE_DIR, "/", rel);
}

// BOS, then n - 1 tokens of the vocabulary picked by `seed`.
inline std::vector<uint32_t> Prompt(const ModelConfig& c, uint32_t n, uint32_t seed) {
  std::vector<uint32_t> ids = {static_cast<uint32_t>(c.bos_token_id)};
  for (uint32_t i = 1; i < n; ++i) ids.push_back(1 + (seed + i * 7919) % (c.vocab_size - 1));
  return ids;
}

}  // namespace strata::model::cuda::testing_helpers
