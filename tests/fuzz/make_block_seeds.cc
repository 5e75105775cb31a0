// Writes a few valid blocks of different shapes into a directory, as the fuzzer's seed corpus.
//   make_block_seeds DIR
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/block_reader.h"
#include "common/block_writer.h"
#include "kernels/codec.h"
#include "kernels/synthetic_kv.h"
#include "kvstore/block_store.h"
#include "tests/fuzz/fuzz_calibration.h"

namespace {

bool Write(const std::string& path, const strata::AlignedBuffer& b) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(b.data(), 1, b.size(), f) == b.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_block_seeds DIR\n");
    return 2;
  }
  using namespace strata;
  struct Seed {
    const char* name;
    CodecId codec;
    const char* spec;
    uint32_t t, h, d;
    bool lowrank, outliers, fullprec;
    ElemType code;
  };
  const Seed seeds[] = {
      {"fp16", CodecId::kFp16, "fp16", 4, 1, 8, false, false, false, ElemType::kFloat16},
      {"kivi", CodecId::kKivi, "kivi:k2v2:g32", 16, 2, 16, false, false, false, ElemType::kUInt2},
      {"gear", CodecId::kGear, "gear:k4v4:g16:r2:s2", 9, 2, 8, true, true, false, ElemType::kUInt4},
      {"zip", CodecId::kZipCache, "zipcache:k3v3", 5, 1, 8, false, false, true, ElemType::kUInt3},
  };
  std::mt19937 rng(1);
  for (const Seed& s : seeds) {
    BlockHeader h;
    h.codec = s.codec;
    h.codec_spec = s.spec;
    h.token_count = s.t;
    h.kv_heads = s.h;
    h.head_dim = s.d;
    const uint32_t hd = s.h * s.d;
    std::vector<SectionDesc> d;
    for (Tensor t : {Tensor::kKey, Tensor::kValue}) {
      const uint32_t fp_tokens = s.fullprec ? 1 : 0;
      d.push_back({SectionKind::kCodes, t, s.code, (s.t - fp_tokens) * hd});
      if (s.fullprec) {
        d.push_back({SectionKind::kFullPrecisionValues, t, ElemType::kFloat16, hd});
        d.push_back({SectionKind::kFullPrecisionTokens, t, ElemType::kUInt16, 1});
      }
      d.push_back({SectionKind::kScales, t, ElemType::kFloat16, hd});
      if (s.lowrank) {
        d.push_back({SectionKind::kLowRankA, t, ElemType::kFloat16, s.h * s.t * 2});
        d.push_back({SectionKind::kLowRankB, t, ElemType::kFloat16, hd * 2});
      }
      if (s.outliers) {
        d.push_back({SectionKind::kOutlierValues, t, ElemType::kFloat16, 3});
        d.push_back({SectionKind::kOutlierIndices, t, ElemType::kUInt16, 3});
      }
    }
    absl::StatusOr<BlockBuilder> b = BlockBuilder::Create(h, d);
    if (!b.ok()) {
      std::fprintf(stderr, "%s: %s\n", s.name, std::string(b.status().message()).c_str());
      return 1;
    }
    for (int i = 0; i < b->layout().section_count(); ++i) {
      for (uint8_t& x : b->section(i)) x = static_cast<uint8_t>(rng());
    }
    if (!Write(std::string(argv[1]) + "/" + s.name + ".blk", std::move(*b).Finish())) {
      std::perror(argv[1]);
      return 1;
    }
  }
  // Blocks from the real codecs, small shapes, for the attention fuzzer.
  const char* specs[] = {"fp16",
                         "bf16",
                         "int8",
                         "fp8e4m3",
                         "kivi:k2v2:g8",
                         "kivi:k3v3:g16",
                         "kcvt:k4v4",
                         "gearl:k2v2:g8:r2",
                         "gear:k2v2:g8:r2:s10",
                         "gear:k2v2:g8:r2:s10:sink2",
                         "zipcache:k2v2:h4:s20:sink1",
                         "tada:k2v2:g8:m8",
                         "kcvt:k2v2:m8:sink2"};
  // And head dims the AVX2 integer kernels take (a multiple of 32), with an odd token count.
  const char* integer_specs[] = {
      "kivi:k2v2:g8",        "kivi:k3v3:g16",       "kivi:k4v4:g8", "kcvt:k2v2",
      "gear:k3v3:g8:r2:s10", "kivi:k3v3:g32:sink2", "kivi:k8v8:g8", "int8"};
  int i = 0;
  auto encode = [&](const char* spec, uint32_t kv_heads, uint32_t dim) {
    auto codec = kernels::Codec::Create(spec);
    const kernels::SyntheticKv kv = kernels::MakeSyntheticKv(9, kv_heads, dim, 3);
    absl::StatusOr<AlignedBuffer> b = (*codec)->Encode(
        {kv.k.data(), kv.v.data(), SourceDType::kFloat32, 9, kv_heads, dim}, {});
    if (!b.ok() || !Write(std::string(argv[1]) + "/codec" + std::to_string(i++) + ".blk", *b)) {
      std::fprintf(stderr, "%s: cannot make a seed\n", spec);
      return false;
    }
    return true;
  };
  for (const char* spec : specs) {
    if (!encode(spec, 2, 8)) return 1;
  }
  for (const char* spec : integer_specs) {
    if (!encode(spec, 1, 64)) return 1;
  }
  // CQ blocks, made with the calibration the attention fuzzer holds; and that calibration as a
  // seed of the calibration-file fuzzer.
  auto cal = std::make_shared<kernels::Calibration>(fuzz::CqCalibration());
  for (const std::string& spec :
       {std::string(fuzz::kCqSpec), std::string(fuzz::kCqSpec) + ":sink2"}) {
    const kernels::SyntheticKv kv =
        kernels::MakeSyntheticKv(9, fuzz::kCqKvHeads, fuzz::kCqHeadDim, 3);
    absl::StatusOr<std::unique_ptr<kernels::Codec>> codec = kernels::Codec::Create(spec, cal);
    absl::StatusOr<AlignedBuffer> b =
        codec.ok() ? (*codec)->Encode({kv.k.data(), kv.v.data(), SourceDType::kFloat32, 9,
                                       fuzz::kCqKvHeads, fuzz::kCqHeadDim},
                                      {})
                   : codec.status();
    if (!b.ok() || !Write(std::string(argv[1]) + "/codec" + std::to_string(i++) + ".blk", *b)) {
      std::fprintf(stderr, "%s: cannot make a seed\n", spec.c_str());
      return 1;
    }
  }
  // The calibration, and the same with CQ's channel metrics (k_metric, v_metric).
  kernels::Calibration with_metrics = *cal;
  for (kernels::LayerCalibration& l : with_metrics.layers) {
    for (std::vector<float>* m : {&l.k_metric, &l.v_metric}) {
      m->resize(size_t{fuzz::kCqKvHeads} * fuzz::kCqHeadDim);
      for (size_t j = 0; j < m->size(); ++j) (*m)[j] = 0.25f + 0.125f * static_cast<float>(j % 13);
    }
  }
  for (const auto& [name, c] : {std::pair{"calibration.json", cal.get()},
                                std::pair{"calibration-metrics.json", &with_metrics}}) {
    const std::string text = c->Serialize();
    FILE* f = std::fopen((std::string(argv[1]) + "/" + name).c_str(), "wb");
    if (f == nullptr || std::fwrite(text.data(), 1, text.size(), f) != text.size() ||
        std::fclose(f) != 0) {
      std::perror(argv[1]);
      return 1;
    }
  }
  // A safetensors file and a config.json for the model-file fuzzer.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})";
  std::string st(8, '\0');
  for (int b = 0; b < 8; ++b) st[b] = static_cast<char>((header.size() >> (8 * b)) & 0xff);
  st += header + std::string(12, '\x11');
  const std::string config =
      R"({"model_type":"llama","vocab_size":512,"hidden_size":128,"intermediate_size":256,)"
      R"("num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,)"
      R"("rope_scaling":{"rope_type":"llama3","factor":8.0},"eos_token_id":[1,2]})";
  const std::string tokenizer =
      R"({"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2,"\u0120":3},"merges":["a b"]},)"
      R"("added_tokens":[{"id":4,"content":"<|x|>"}],"pre_tokenizer":{"type":"Sequence",)"
      R"("pretokenizers":[{"type":"Split","pattern":{"Regex":"\\s+(?!\\S)|\\s+|\\p{L}+"}},)"
      R"({"type":"ByteLevel","use_regex":false}]}})";
  for (const auto& [name, text] :
       {std::pair{"model.safetensors", st}, std::pair{"config.json", config},
        std::pair{"tokenizer.json", tokenizer}}) {
    FILE* f = std::fopen((std::string(argv[1]) + "/" + name).c_str(), "wb");
    if (f == nullptr || std::fwrite(text.data(), 1, text.size(), f) != text.size()) return 1;
    std::fclose(f);
  }
  // What etcd gives the cluster: a node's registration, a watch line, a range answer.
  for (const auto& [name, text] : {
           std::pair{"etcd-node.json",
                     R"({"id":"decode-0","role":"decode","grpc":"10.0.0.2:7100",)"
                     R"("transport":"10.0.0.2:7200","metrics":"10.0.0.2:9100"})"},
           std::pair{"etcd-watch.json",
                     R"({"result":{"header":{"revision":"42"},"events":[{"type":"DELETE",)"
                     R"("kv":{"key":"L3N0cmF0YS9ub2Rlcy9h","mod_revision":"41"}},{"kv":{"key":)"
                     R"("L3N0cmF0YS9ub2Rlcy9i","value":"e30=","lease":"7"}}]}})"},
           std::pair{"etcd-range.json",
                     R"({"header":{"revision":"9"},"kvs":[{"key":"YQ==","value":"Yg==",)"
                     R"("mod_revision":"3"}],"count":"1"})"}}) {
    const std::string t = text;
    FILE* f = std::fopen((std::string(argv[1]) + "/" + name).c_str(), "wb");
    if (f == nullptr || std::fwrite(t.data(), 1, t.size(), f) != t.size()) return 1;
    std::fclose(f);
  }
  // A block log as a store writes it (two chunks of one prefix, tagged), for the store's
  // recovery fuzzer.
  {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path(argv[1]) / "store-tmp";
    fs::remove_all(dir);
    kvstore::StoreOptions o;
    o.ram_bytes = size_t{1} << 20;
    o.disk_path = dir.string();
    o.disk_bytes = size_t{1} << 26;
    {
      absl::StatusOr<std::unique_ptr<kvstore::BlockStore>> store = kvstore::BlockStore::Open(o);
      if (!store.ok()) return 1;
      auto codec = kernels::Codec::Create("kivi:k2v2:g8");
      const kernels::SyntheticKv kv = kernels::MakeSyntheticKv(8, 1, 8, 5);
      BlockHash parent{};
      for (uint32_t chunk = 0; chunk < 2; ++chunk) {
        absl::StatusOr<AlignedBuffer> b = (*codec)->Encode(
            {kv.k.data(), kv.v.data(), SourceDType::kFloat32, 8, 1, 8},
            {.layer = 0, .chunk_index = chunk, .model_fingerprint = 0x77});
        if (!b.ok()) return 1;
        const BlockHeader h = BlockView::Parse(b->span())->header();
        BlockHash key{};
        key[0] = static_cast<uint8_t>(chunk + 1);
        const BlockName name{h.model_fingerprint, h.codec_fingerprint,
                                      h.calibration_fingerprint, key, h.layer};
        if (!(*store)->Put(name, chunk == 0 ? nullptr : &parent, b->span()).ok()) return 1;
        parent = key;
      }
      (*store)->Flush();
    }
    fs::copy_file(dir / "blocks" / "1.log", fs::path(argv[1]) / "store-block-log.bin",
                  fs::copy_options::overwrite_existing);
    fs::remove_all(dir);
  }
  return 0;
}
