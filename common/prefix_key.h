// Prefix keys: vLLM's chained block hash (shared/specs/prefix-keys.md), so that vLLM, Dynamo's
// KV router or llm-d can reason about Strata's blocks with the keys they already compute.
//
//   NONE_HASH = hash_fn(seed)
//   H[i]      = hash_fn((H[i-1] or NONE_HASH, tuple(tokens[i*B:(i+1)*B]), extra_keys_i))
//   extra_keys_i = None, or a tuple of (LoRA name, every block) and (cache salt, block 0 only)
//
// hash_fn is SHA-256 over canonical CBOR ("sha256_cbor", Strata's default) or over Python pickle
// protocol 5 ("sha256", vLLM's default), serialized byte-for-byte as CPython and python3-cbor2
// do. Only full blocks are hashed. A chunk of C tokens (C a multiple of B) is keyed by the hash
// of its last block, which covers the whole prefix before it.
//
// The chain holds no model, dtype or layout: a block in the store is named by BlockName, which
// puts (model, codec, calibration) fingerprints and the layer beside the key.
//
// Pickle writes a memo reference when the cache salt is the very same Python object as the LoRA
// name. Strata reproduces the one case where CPython makes equal strings the same object on its
// own: one-character Latin-1 strings. Equal longer strings from separate sources are separate
// objects in vLLM, and are written twice, as CPython does.
//
// PrefixHasher is immutable after Create and safe to share between threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/sha256.h"

namespace strata {

using BlockHash = Sha256Digest;

enum class PrefixHashAlgorithm { kSha256Cbor, kSha256Pickle };

// "sha256_cbor" or "sha256"; kInvalidArgument otherwise.
absl::StatusOr<PrefixHashAlgorithm> ParsePrefixHashAlgorithm(absl::string_view name);
const char* PrefixHashAlgorithmName(PrefixHashAlgorithm algorithm);

struct PrefixKeyOptions {
  // Serialization under SHA-256.
  PrefixHashAlgorithm algorithm = PrefixHashAlgorithm::kSha256Cbor;
  // Tokens per hash block (vLLM's block size), 1..4096.
  uint32_t block_tokens = 16;
  // Tokens per Strata chunk: a multiple of block_tokens, at most 1 << 20.
  uint32_t chunk_tokens = 256;
  // Text hashed into NONE_HASH: vLLM's default, or the PYTHONHASHSEED a deployment pins ("0").
  std::string seed = "vllm-none-hash";
  // LoRA adapter name; empty means no LoRA. UTF-8, at most 4096 bytes.
  std::string lora_name;
  // Per-tenant cache salt (first block only); empty means none, as in vLLM. UTF-8, <= 4096 bytes.
  std::string cache_salt;

  absl::Status Validate() const;
};

class PrefixHasher {
 public:
  static absl::StatusOr<PrefixHasher> Create(PrefixKeyOptions options);

  const PrefixKeyOptions& options() const { return options_; }
  const BlockHash& none_hash() const { return none_hash_; }

  // Hash of one block of options().block_tokens tokens after `parent` (none_hash() for the
  // first block); `first_block` adds the cache salt. Tokens must be block_tokens long.
  BlockHash HashBlock(const BlockHash& parent, absl::Span<const uint32_t> tokens,
                      bool first_block) const;

  // H[i] for every full block of `tokens`, chained from none_hash().
  std::vector<BlockHash> BlockHashes(absl::Span<const uint32_t> tokens) const;

  // The key of every full chunk of `tokens`: the hash of its last block.
  std::vector<BlockHash> ChunkKeys(absl::Span<const uint32_t> tokens) const;

  // The exact bytes hashed for one block (exposed for tests against the Python oracles).
  std::string SerializeBlock(const BlockHash& parent, absl::Span<const uint32_t> tokens,
                             bool first_block) const;
  // The exact bytes hashed for NONE_HASH.
  std::string SerializeSeed() const;

 private:
  explicit PrefixHasher(PrefixKeyOptions options) : options_(std::move(options)) {}
  PrefixKeyOptions options_;
  BlockHash none_hash_{};
};

// The 64-bit form vLLM's KV events carry: the digest's last 8 bytes read big-endian.
uint64_t EventHash64(const BlockHash& hash);

// What a block is stored under: a namespace (model, codec, calibration) beside the prefix key,
// and the layer. Encode() gives a fixed 60-byte, big-endian key whose byte order sorts by
// namespace, then prefix key, then layer (all layers of one chunk are adjacent).
struct BlockName {
  static constexpr size_t kEncodedBytes = 8 + 8 + 8 + 32 + 4;

  uint64_t model_fingerprint = 0;
  uint64_t codec_fingerprint = 0;
  uint64_t calibration_fingerprint = 0;
  BlockHash key{};
  uint32_t layer = 0;

  std::string Encode() const;
  // kInvalidArgument unless `bytes` is exactly kEncodedBytes long.
  static absl::StatusOr<BlockName> Decode(absl::string_view bytes);
  // "model=..:codec=..:calib=..:key=<64 hex>:layer=N", for logs and tools.
  std::string ToString() const;

  friend bool operator==(const BlockName&, const BlockName&) = default;
};

}  // namespace strata
