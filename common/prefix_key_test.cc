#include "common/prefix_key.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

PrefixHasher MakeHasher(PrefixHashAlgorithm algo, std::string seed, uint32_t b = 16,
                        uint32_t c = 256, std::string lora = "", std::string salt = "") {
  PrefixKeyOptions o;
  o.algorithm = algo;
  o.seed = std::move(seed);
  o.block_tokens = b;
  o.chunk_tokens = c;
  o.lora_name = std::move(lora);
  o.cache_salt = std::move(salt);
  absl::StatusOr<PrefixHasher> h = PrefixHasher::Create(o);
  EXPECT_TRUE(h.ok()) << h.status();
  return *std::move(h);
}

// Known values from shared/specs/prefix-keys.md.
TEST(PrefixKeyTest, PinnedKnownValues) {
  using A = PrefixHashAlgorithm;
  EXPECT_EQ(ToHex(MakeHasher(A::kSha256Pickle, "0").none_hash()),
            "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c");
  EXPECT_EQ(ToHex(MakeHasher(A::kSha256Pickle, "vllm-none-hash").none_hash()),
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198");
  EXPECT_EQ(ToHex(MakeHasher(A::kSha256Cbor, "vllm-none-hash").none_hash()),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0");
  EXPECT_EQ(ToHex(MakeHasher(A::kSha256Cbor, "0").none_hash()),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e");
  const PrefixHasher h = MakeHasher(A::kSha256Pickle, "0", /*b=*/4, /*c=*/4);
  const std::vector<uint32_t> tokens = {1, 2, 3, 4};
  const std::vector<BlockHash> blocks = h.BlockHashes(tokens);
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(ToHex(blocks[0]), "762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d");
  // The seed's CBOR from the spec.
  EXPECT_EQ(ToHex(reinterpret_cast<const uint8_t*>(
                      MakeHasher(A::kSha256Cbor, "vllm-none-hash").SerializeSeed().data()),
                  15),
            "6e766c6c6d2d6e6f6e652d68617368");
}

TEST(PrefixKeyTest, ChainsOnlyFullBlocksAndKeysChunksByTheirLastBlock) {
  const PrefixHasher h = MakeHasher(PrefixHashAlgorithm::kSha256Cbor, "vllm-none-hash", 16, 64);
  std::vector<uint32_t> tokens(64 * 3 + 40);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7919 % 50000);
  const std::vector<BlockHash> blocks = h.BlockHashes(tokens);
  ASSERT_EQ(blocks.size(), tokens.size() / 16);  // 14 full blocks; the last 8 tokens are not
  const std::vector<BlockHash> chunks = h.ChunkKeys(tokens);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0], blocks[3]);
  EXPECT_EQ(chunks[1], blocks[7]);
  EXPECT_EQ(chunks[2], blocks[11]);
  // A shared prefix gives shared keys; a change in chunk 1 changes every later key.
  std::vector<uint32_t> other = tokens;
  other[64 + 5] += 1;
  const std::vector<BlockHash> other_chunks = h.ChunkKeys(other);
  EXPECT_EQ(other_chunks[0], chunks[0]);
  EXPECT_NE(other_chunks[1], chunks[1]);
  EXPECT_NE(other_chunks[2], chunks[2]);
  // Incremental hashing from a parent equals hashing the whole sequence.
  EXPECT_EQ(h.HashBlock(blocks[4], absl::MakeSpan(tokens).subspan(5 * 16, 16), false), blocks[5]);
}

TEST(PrefixKeyTest, CacheSaltIsolatesTenantsAndLoraNamesEveryBlock) {
  using A = PrefixHashAlgorithm;
  std::vector<uint32_t> tokens(64, 5);
  const auto plain = MakeHasher(A::kSha256Cbor, "s", 16, 32).BlockHashes(tokens);
  const auto salted = MakeHasher(A::kSha256Cbor, "s", 16, 32, "", "tenant-a").BlockHashes(tokens);
  const auto salted_b = MakeHasher(A::kSha256Cbor, "s", 16, 32, "", "tenant-b").BlockHashes(tokens);
  const auto lora = MakeHasher(A::kSha256Cbor, "s", 16, 32, "adapter", "").BlockHashes(tokens);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NE(plain[i], salted[i]) << i;  // the salt reaches every block through the chain
    EXPECT_NE(salted[i], salted_b[i]) << i;
    EXPECT_NE(plain[i], lora[i]) << i;
  }
}

TEST(PrefixKeyTest, OptionsAreValidatedWithClearErrors) {
  PrefixKeyOptions o;
  o.block_tokens = 0;
  EXPECT_THAT(std::string(o.Validate().message()), testing::HasSubstr("block_tokens 0"));
  o = {};
  o.chunk_tokens = 250;  // not a multiple of 16
  EXPECT_EQ(PrefixHasher::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(o.Validate().message()), testing::HasSubstr("chunk_tokens 250"));
  o = {};
  o.cache_salt = "bad\xff";
  EXPECT_THAT(std::string(o.Validate().message()),
              testing::HasSubstr("cache_salt is not valid UTF-8"));
  o = {};
  o.lora_name = std::string(5000, 'x');
  EXPECT_THAT(std::string(o.Validate().message()), testing::HasSubstr("lora_name is 5000 bytes"));
  EXPECT_EQ(ParsePrefixHashAlgorithm("md5").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParsePrefixHashAlgorithm("sha256"), PrefixHashAlgorithm::kSha256Pickle);
  EXPECT_EQ(*ParsePrefixHashAlgorithm("sha256_cbor"), PrefixHashAlgorithm::kSha256Cbor);
}

TEST(PrefixKeyTest, EventHashIsTheLastEightBytesBigEndian) {
  BlockHash h{};
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(EventHash64(h), 0x18191a1b1c1d1e1full);
}

TEST(BlockNameTest, EncodeDecodeRoundTripsAndSortsByNamespaceKeyLayer) {
  BlockName a;
  a.model_fingerprint = 0x0102030405060708ull;
  a.codec_fingerprint = 0xfffefdfcfbfaf9f8ull;
  a.calibration_fingerprint = 7;
  for (size_t i = 0; i < a.key.size(); ++i) a.key[i] = static_cast<uint8_t>(200 + i);
  a.layer = 31;
  const std::string enc = a.Encode();
  ASSERT_EQ(enc.size(), BlockName::kEncodedBytes);
  absl::StatusOr<BlockName> back = BlockName::Decode(enc);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, a);
  BlockName b = a;
  b.layer = 256;  // big-endian: layer 256 sorts after layer 31
  EXPECT_LT(a.Encode(), b.Encode());
  BlockName c = a;
  c.key[0] = 0;
  c.layer = 999;
  EXPECT_LT(c.Encode(), a.Encode());  // key before layer
  EXPECT_EQ(BlockName::Decode(enc.substr(1)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.ToString(), testing::HasSubstr(":layer=31"));
}

// ---- cross-check against CPython's pickle and python3-cbor2 ----

std::string Hex(absl::string_view s) {
  return s.empty() ? "-" : ToHex(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

struct OracleCase {
  PrefixHashAlgorithm algo;
  uint32_t b;
  std::string seed, lora, salt;
  std::vector<uint32_t> tokens;
};

uint32_t RandomToken(std::mt19937& rng) {
  // Every integer encoding: CBOR immediate / 1 / 2 / 4 bytes; pickle BININT1/2/BININT/LONG1.
  switch (rng() % 6) {
    case 0:
      return rng() % 24;
    case 1:
      return 24 + rng() % 232;
    case 2:
      return 256 + rng() % 65280;
    case 3:
      return 65536 + rng() % 200000;
    case 4:
      return 0x7fffffffu - rng() % 3 + (rng() % 2) * 2;  // around 2^31
    default:
      return rng();
  }
}

std::string RandomText(std::mt19937& rng) {
  static const char* kPieces[] = {
      "a", "tenant", "caf\xc3\xa9",    "\xe6\x97\xa5\xe6\x9c\xac", "\xf0\x9f\x98\x80",
      " ", "0",      "lora-adapter_v2"};
  std::string s;
  const int n = rng() % 4 == 0 ? 120 : static_cast<int>(rng() % 6);  // sometimes > 255 bytes
  for (int i = 0; i < n; ++i) s += kPieces[rng() % 8];
  return s;
}

TEST(PrefixKeyOracleTest, MatchesCPythonPickleAndCbor2OnRandomSequences) {
  std::mt19937 rng(20261121);
  std::vector<OracleCase> cases;
  for (int i = 0; i < 120; ++i) {
    OracleCase c;
    c.algo = i % 2 ? PrefixHashAlgorithm::kSha256Pickle : PrefixHashAlgorithm::kSha256Cbor;
    const uint32_t sizes[] = {1, 2, 3, 4, 16, 23, 24, 32, 300};
    c.b = sizes[rng() % 9];
    c.seed = i % 5 == 0 ? "0" : i % 5 == 1 ? "vllm-none-hash" : RandomText(rng);
    if (rng() % 2) c.lora = RandomText(rng);
    if (rng() % 2) c.salt = RandomText(rng);
    const size_t n = rng() % (c.b * 5 + 3);
    for (size_t t = 0; t < n; ++t) c.tokens.push_back(RandomToken(rng));
    cases.push_back(std::move(c));
  }
  // CPython shares one object per 1-character Latin-1 string: a LoRA name and a salt that are
  // both such a string pickle as a memo reference. Longer equal strings do not.
  for (const char* same : {"a", "\xc3\xa9", "ab", "\xe6\x97\xa5"}) {
    for (auto algo : {PrefixHashAlgorithm::kSha256Pickle, PrefixHashAlgorithm::kSha256Cbor}) {
      cases.push_back({algo, 4, "0", same, same, {1, 2, 3, 4, 5, 6, 7, 8}});
    }
  }
  const std::string dir = testing::TempDir();
  const std::string in_path = absl::StrCat(dir, "/prefix_oracle_in.txt");
  const std::string out_path = absl::StrCat(dir, "/prefix_oracle_out.txt");
  {
    std::ofstream in(in_path);
    for (const OracleCase& c : cases) {
      in << PrefixHashAlgorithmName(c.algo) << ' ' << c.b << ' ' << Hex(c.seed) << ' '
         << Hex(c.lora) << ' ' << Hex(c.salt) << ' '
         << (c.tokens.empty() ? "-" : absl::StrJoin(c.tokens, ",")) << '\n';
    }
  }
  const std::string cmd =
      absl::StrCat(STRATA_PYTHON, " ", STRATA_SOURCE_DIR, "/tests/oracles/prefix_keys_oracle.py < ",
                   in_path, " > ", out_path);
  ASSERT_EQ(std::system(cmd.c_str()), 0)
      << "oracle failed: " << cmd << " (needs Debian's python3-cbor2; run scripts/setup.sh)";
  std::ifstream out(out_path);
  for (const OracleCase& c : cases) {
    std::string hashes_line, bytes_line;
    ASSERT_TRUE(std::getline(out, hashes_line));
    ASSERT_TRUE(std::getline(out, bytes_line));
    const PrefixHasher h = MakeHasher(c.algo, c.seed, c.b, c.b, c.lora, c.salt);
    const std::vector<BlockHash> mine = h.BlockHashes(c.tokens);
    std::vector<std::string> mine_hex;
    for (const BlockHash& x : mine) mine_hex.push_back(ToHex(x));
    EXPECT_EQ(mine_hex.empty() ? "-" : absl::StrJoin(mine_hex, " "), hashes_line)
        << PrefixHashAlgorithmName(c.algo) << " B=" << c.b << " seed=" << c.seed;
    const std::string first =
        mine.empty() ? h.SerializeSeed()
                     : h.SerializeBlock(h.none_hash(), absl::MakeSpan(c.tokens).first(c.b), true);
    EXPECT_EQ(Hex(first), bytes_line) << PrefixHashAlgorithmName(c.algo) << " B=" << c.b;
  }
}

}  // namespace
}  // namespace strata
