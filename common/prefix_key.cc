#include "common/prefix_key.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "common/utf8.h"

namespace strata {
namespace {

constexpr uint32_t kMaxBlockTokens = 4096;
constexpr uint32_t kMaxChunkTokens = 1u << 20;
constexpr size_t kMaxTextBytes = 4096;

// ---- canonical CBOR (RFC 8949 preferred serialization), as cbor2.dumps(canonical=True) ----

void CborHead(std::string& out, uint8_t major, uint64_t v) {
  const uint8_t m = static_cast<uint8_t>(major << 5);
  if (v < 24) {
    out.push_back(static_cast<char>(m | v));
    return;
  }
  int bytes;
  if (v <= 0xff) {
    out.push_back(static_cast<char>(m | 24));
    bytes = 1;
  } else if (v <= 0xffff) {
    out.push_back(static_cast<char>(m | 25));
    bytes = 2;
  } else if (v <= 0xffffffffull) {
    out.push_back(static_cast<char>(m | 26));
    bytes = 4;
  } else {
    out.push_back(static_cast<char>(m | 27));
    bytes = 8;
  }
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>(v >> (8 * i)));
}

void CborText(std::string& out, absl::string_view s) {
  CborHead(out, 3, s.size());
  out.append(s.data(), s.size());
}

// ---- pickle protocol 5, as CPython's C pickler writes it ----
// Opcodes used (pickletools names).
constexpr char kProto = '\x80', kFrame = '\x95', kShortBinBytes = 'C', kMemoize = '\x94',
               kMark = '(', kTuple = 't', kTuple1 = '\x85', kTuple2 = '\x86', kTuple3 = '\x87',
               kEmptyTuple = ')', kBinInt1 = 'K', kBinInt2 = 'M', kBinInt = 'J', kLong1 = '\x8a',
               kNone = 'N', kShortBinUnicode = '\x8c', kBinUnicode = 'X', kStop = '.',
               kBinGet = 'h';

// True for the strings CPython shares as singletons: one code point up to U+00FF.
bool IsSharedPythonString(absl::string_view s) {
  if (s.size() == 1) return static_cast<unsigned char>(s[0]) < 0x80;
  return s.size() == 2 &&
         (static_cast<unsigned char>(s[0]) == 0xc2 || static_cast<unsigned char>(s[0]) == 0xc3);
}

void PutLE(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

void PickleInt(std::string& out, uint32_t v) {
  if (v <= 0xff) {
    out.push_back(kBinInt1);
    PutLE(out, v, 1);
  } else if (v <= 0xffff) {
    out.push_back(kBinInt2);
    PutLE(out, v, 2);
  } else if (v <= 0x7fffffffu) {
    out.push_back(kBinInt);
    PutLE(out, v, 4);
  } else {
    // LONG1: little-endian two's complement; 2^31..2^32-1 need a fifth (sign) byte of 0.
    out.push_back(kLong1);
    out.push_back('\x05');
    PutLE(out, v, 4);
    out.push_back('\0');
  }
}

void PickleStr(std::string& out, absl::string_view s) {
  if (s.size() < 256) {
    out.push_back(kShortBinUnicode);
    PutLE(out, s.size(), 1);
  } else {
    out.push_back(kBinUnicode);
    PutLE(out, s.size(), 4);
  }
  out.append(s.data(), s.size());
  out.push_back(kMemoize);
}

// Closes a tuple of n already-written items (after a MARK when n > 3).
void PickleTupleEnd(std::string& out, size_t n) {
  if (n == 0) {
    out.push_back(kEmptyTuple);  // the empty tuple is a singleton: not memoized
    return;
  }
  out.push_back(n == 1 ? kTuple1 : n == 2 ? kTuple2 : n == 3 ? kTuple3 : kTuple);
  out.push_back(kMemoize);
}

// Wraps a pickle body (everything after PROTO and FRAME) as protocol 5 with one frame. Bodies
// here stay far below the pickler's 64 KiB frame target (options limit their size), so CPython
// writes exactly one frame too.
std::string PickleFrame(const std::string& body) {
  std::string out;
  out.push_back(kProto);
  out.push_back('\x05');
  out.push_back(kFrame);
  PutLE(out, body.size(), 8);
  out += body;
  return out;
}

}  // namespace

absl::StatusOr<PrefixHashAlgorithm> ParsePrefixHashAlgorithm(absl::string_view name) {
  if (name == "sha256_cbor") return PrefixHashAlgorithm::kSha256Cbor;
  if (name == "sha256") return PrefixHashAlgorithm::kSha256Pickle;
  return absl::InvalidArgumentError(absl::StrCat("prefix hash algorithm '", name,
                                                 "' is not one of sha256_cbor (default), sha256"));
}

const char* PrefixHashAlgorithmName(PrefixHashAlgorithm algorithm) {
  return algorithm == PrefixHashAlgorithm::kSha256Cbor ? "sha256_cbor" : "sha256";
}

absl::Status PrefixKeyOptions::Validate() const {
  if (block_tokens < 1 || block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat("prefix keys: block_tokens ", block_tokens,
                                                   " outside [1, ", kMaxBlockTokens, "]"));
  }
  if (chunk_tokens < 1 || chunk_tokens > kMaxChunkTokens || chunk_tokens % block_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix keys: chunk_tokens ", chunk_tokens,
                                                   " must be a multiple of ", "block_tokens ",
                                                   block_tokens, " and at most ", kMaxChunkTokens));
  }
  const std::pair<const char*, const std::string*> texts[] = {
      {"seed", &seed}, {"lora_name", &lora_name}, {"cache_salt", &cache_salt}};
  for (const auto& [name, text] : texts) {
    if (text->size() > kMaxTextBytes) {
      return absl::InvalidArgumentError(absl::StrCat("prefix keys: ", name, " is ", text->size(),
                                                     " bytes, at most ", kMaxTextBytes));
    }
    size_t at = 0;
    if (!IsValidUtf8(*text, &at)) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix keys: ", name, " is not valid UTF-8 (byte ", at, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefixHasher> PrefixHasher::Create(PrefixKeyOptions options) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  PrefixHasher h(std::move(options));
  h.none_hash_ = Sha256::Hash(h.SerializeSeed());
  return h;
}

std::string PrefixHasher::SerializeSeed() const {
  std::string out;
  if (options_.algorithm == PrefixHashAlgorithm::kSha256Cbor) {
    CborText(out, options_.seed);
    return out;
  }
  std::string body;
  PickleStr(body, options_.seed);
  body.push_back(kStop);
  return PickleFrame(body);
}

std::string PrefixHasher::SerializeBlock(const BlockHash& parent, absl::Span<const uint32_t> tokens,
                                         bool first_block) const {
  STRATA_CHECK(tokens.size() == options_.block_tokens, "SerializeBlock needs exactly one block");
  absl::string_view extra[2];
  size_t n_extra = 0;
  if (!options_.lora_name.empty()) extra[n_extra++] = options_.lora_name;
  if (first_block && !options_.cache_salt.empty()) extra[n_extra++] = options_.cache_salt;

  std::string out;
  if (options_.algorithm == PrefixHashAlgorithm::kSha256Cbor) {
    out.reserve(40 + 5 * tokens.size());
    CborHead(out, 4, 3);
    CborHead(out, 2, parent.size());
    out.append(reinterpret_cast<const char*>(parent.data()), parent.size());
    CborHead(out, 4, tokens.size());
    for (uint32_t t : tokens) CborHead(out, 0, t);
    if (n_extra == 0) {
      out.push_back('\xf6');  // null
    } else {
      CborHead(out, 4, n_extra);
      for (size_t i = 0; i < n_extra; ++i) CborText(out, extra[i]);
    }
    return out;
  }

  std::string body;
  body.reserve(48 + 5 * tokens.size());
  body.push_back(kShortBinBytes);
  PutLE(body, parent.size(), 1);
  body.append(reinterpret_cast<const char*>(parent.data()), parent.size());
  body.push_back(kMemoize);
  if (tokens.size() > 3) body.push_back(kMark);
  for (uint32_t t : tokens) PickleInt(body, t);
  PickleTupleEnd(body, tokens.size());
  if (n_extra == 0) {
    body.push_back(kNone);
  } else {
    PickleStr(body, extra[0]);
    if (n_extra == 2 && extra[1] == extra[0] && IsSharedPythonString(extra[0])) {
      // CPython keeps one object for each 1-character Latin-1 string, so a salt equal to the
      // LoRA name is the same object and pickle refers back to it: memo 2 (after the parent
      // bytes and the token tuple).
      body.push_back(kBinGet);
      body.push_back('\x02');
    } else if (n_extra == 2) {
      PickleStr(body, extra[1]);
    }
    PickleTupleEnd(body, n_extra);
  }
  PickleTupleEnd(body, 3);
  body.push_back(kStop);
  return PickleFrame(body);
}

BlockHash PrefixHasher::HashBlock(const BlockHash& parent, absl::Span<const uint32_t> tokens,
                                  bool first_block) const {
  STRATA_CHECK(tokens.size() == options_.block_tokens, "HashBlock needs exactly one block");
  return Sha256::Hash(SerializeBlock(parent, tokens, first_block));
}

std::vector<BlockHash> PrefixHasher::BlockHashes(absl::Span<const uint32_t> tokens) const {
  const size_t b = options_.block_tokens;
  std::vector<BlockHash> out;
  out.reserve(tokens.size() / b);
  const BlockHash* parent = &none_hash_;
  for (size_t i = 0; (i + 1) * b <= tokens.size(); ++i) {
    out.push_back(HashBlock(*parent, tokens.subspan(i * b, b), i == 0));
    parent = &out.back();
  }
  return out;
}

std::vector<BlockHash> PrefixHasher::ChunkKeys(absl::Span<const uint32_t> tokens) const {
  const size_t per_chunk = options_.chunk_tokens / options_.block_tokens;
  const size_t full = tokens.size() / options_.chunk_tokens * options_.chunk_tokens;
  std::vector<BlockHash> blocks = BlockHashes(tokens.first(full));
  std::vector<BlockHash> keys;
  keys.reserve(blocks.size() / per_chunk);
  for (size_t i = per_chunk; i <= blocks.size(); i += per_chunk) keys.push_back(blocks[i - 1]);
  return keys;
}

uint64_t EventHash64(const BlockHash& hash) {
  uint64_t v = 0;
  for (size_t i = hash.size() - 8; i < hash.size(); ++i) v = (v << 8) | hash[i];
  return v;
}

std::string BlockName::Encode() const {
  std::string out(kEncodedBytes, '\0');
  size_t pos = 0;
  auto put = [&](uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) out[pos++] = static_cast<char>(v >> (8 * i));
  };
  put(model_fingerprint, 8);
  put(codec_fingerprint, 8);
  put(calibration_fingerprint, 8);
  for (uint8_t b : key) out[pos++] = static_cast<char>(b);
  put(layer, 4);
  return out;
}

absl::StatusOr<BlockName> BlockName::Decode(absl::string_view bytes) {
  if (bytes.size() != kEncodedBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("block name: ", bytes.size(), " bytes, expected ", kEncodedBytes));
  }
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  auto get = [&](int bytes_n) {
    uint64_t v = 0;
    for (int i = 0; i < bytes_n; ++i) v = (v << 8) | *p++;
    return v;
  };
  BlockName n;
  n.model_fingerprint = get(8);
  n.codec_fingerprint = get(8);
  n.calibration_fingerprint = get(8);
  for (uint8_t& b : n.key) b = *p++;
  n.layer = static_cast<uint32_t>(get(4));
  return n;
}

std::string BlockName::ToString() const {
  return absl::StrFormat("model=%016x:codec=%016x:calib=%016x:key=%s:layer=%u", model_fingerprint,
                         codec_fingerprint, calibration_fingerprint, ToHex(key), layer);
}

}  // namespace strata
