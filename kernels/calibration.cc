#include "kernels/calibration.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "kernels/codec_spec.h"
#include "nlohmann/json.hpp"

namespace strata::kernels {
namespace {

using Json = nlohmann::json;

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("calibration: ", what));
}

bool ValidBits(int b) { return b == 0 || b == 2 || b == 3 || b == 4 || b == 8; }

// A codebook's bytes, little-endian.
std::string CodebookBytes(const std::vector<uint16_t>& book) {
  std::string out(book.size() * 2, '\0');
  for (size_t i = 0; i < book.size(); ++i) {
    out[2 * i] = static_cast<char>(book[i] & 0xff);
    out[2 * i + 1] = static_cast<char>(book[i] >> 8);
  }
  return out;
}

}  // namespace

std::string Calibration::Serialize() const {
  Json j;
  j["version"] = kVersion;
  j["codec"] = codec;
  j["model_fingerprint"] = absl::StrCat(absl::Hex(model_fingerprint, absl::kZeroPad16));
  j["kv_heads"] = kv_heads;
  j["head_dim"] = head_dim;
  j["source"] = source;
  j["layers"] = Json::array();
  for (const LayerCalibration& l : layers) {
    Json lj = {{"k_perm", l.k_perm}, {"v_perm", l.v_perm}, {"k_clip", l.k_clip},
               {"v_clip", l.v_clip}, {"k_bits", l.k_bits}, {"v_bits", l.v_bits},
               {"spec", l.spec}};
    for (const auto& [name, book] :
         {std::pair{"k_codebook", &l.k_codebook}, std::pair{"v_codebook", &l.v_codebook}}) {
      if (!book->empty()) lj[name] = absl::Base64Escape(CodebookBytes(*book));
    }
    if (!l.k_metric.empty()) lj["k_metric"] = l.k_metric;
    if (!l.v_metric.empty()) lj["v_metric"] = l.v_metric;
    j["layers"].push_back(std::move(lj));
  }
  return j.dump(1);
}

uint64_t Calibration::fingerprint() const {
  // Over a compact binary form of the content (cheap enough to check per block).
  std::string bytes = absl::StrCat("strata-calibration-", kVersion, "\n", codec, "\n",
                                   model_fingerprint, " ", kv_heads, " ", head_dim, " ",
                                   layers.size(), "\n");
  for (const LayerCalibration& l : layers) {
    absl::StrAppend(&bytes, l.k_perm.size(), " ", l.v_perm.size(), " ", l.k_clip, " ", l.v_clip,
                    " ", l.k_bits, " ", l.v_bits, " ", l.spec, "\n");
    bytes.append(reinterpret_cast<const char*>(l.k_perm.data()), l.k_perm.size() * 2);
    bytes.append(reinterpret_cast<const char*>(l.v_perm.data()), l.v_perm.size() * 2);
    if (!l.k_codebook.empty() || !l.v_codebook.empty()) {
      absl::StrAppend(&bytes, "codebooks ", l.k_codebook.size(), " ", l.v_codebook.size(), "\n",
                      CodebookBytes(l.k_codebook), CodebookBytes(l.v_codebook));
    }
    for (const auto& [name, metric] :
         {std::pair{"k_metric", &l.k_metric}, std::pair{"v_metric", &l.v_metric}}) {
      if (metric->empty()) continue;
      absl::StrAppend(&bytes, name, " ", metric->size(), "\n");
      bytes.append(reinterpret_cast<const char*>(metric->data()), metric->size() * 4);
    }
  }
  const uint64_t f = Fingerprint64(bytes);
  return f == 0 ? 1 : f;
}

absl::StatusOr<Calibration> Calibration::Parse(absl::string_view text) {
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad("not a JSON object");
  Calibration c;
  try {
    if (!j.contains("version") || j["version"].get<int>() != kVersion) {
      return Bad(absl::StrCat("version ", j.contains("version") ? j["version"].dump() : "missing",
                              ", this build reads ", kVersion));
    }
    c.codec = j.at("codec").get<std::string>();
    const std::string fp = j.at("model_fingerprint").get<std::string>();
    if (fp.size() != 16 || !absl::SimpleHexAtoi(fp, &c.model_fingerprint)) {
      return Bad(absl::StrCat("model_fingerprint '", fp, "' is not 16 hex digits"));
    }
    c.kv_heads = j.at("kv_heads").get<uint32_t>();
    c.head_dim = j.at("head_dim").get<uint32_t>();
    c.source = j.value("source", "");
    if (c.kv_heads < 1 || c.kv_heads > 1024 || c.head_dim < 1 || c.head_dim > 1024) {
      return Bad(absl::StrCat("shape ", c.kv_heads, " x ", c.head_dim, " out of range"));
    }
    // CQ's codebooks hold kv_heads x head_dim x 2^b entries; other codecs' hold none.
    const absl::StatusOr<CodecSpec> spec = CodecSpec::Parse(c.codec);
    const size_t codebook_entries =
        spec.ok() && spec->is_codebook()
            ? size_t{c.kv_heads} * c.head_dim * (size_t{1} << spec->k_bits)
            : 0;
    const Json& layers = j.at("layers");
    if (!layers.is_array() || layers.size() > 4096) return Bad("layers must be an array");
    for (size_t i = 0; i < layers.size(); ++i) {
      const Json& lj = layers[i];
      LayerCalibration l;
      l.k_perm = lj.at("k_perm").get<std::vector<uint16_t>>();
      l.v_perm = lj.at("v_perm").get<std::vector<uint16_t>>();
      l.k_clip = lj.at("k_clip").get<float>();
      l.v_clip = lj.at("v_clip").get<float>();
      l.k_bits = lj.at("k_bits").get<int>();
      l.v_bits = lj.at("v_bits").get<int>();
      l.spec = lj.value("spec", "");
      // A layer of a mix that chose CQ holds that shape's codebooks; other layers follow the codec.
      size_t layer_entries = codebook_entries;
      if (!l.spec.empty()) {
        absl::StatusOr<CodecSpec> ls = CodecSpec::Parse(l.spec);
        if (!ls.ok()) return Bad(absl::StrCat("layer ", i, " spec: ", ls.status().message()));
        if (ls->id == CodecId::kStrata) return Bad(absl::StrCat("layer ", i, " spec is a mix"));
        if (ls->is_codebook()) {
          layer_entries = size_t{c.kv_heads} * c.head_dim * (size_t{1} << ls->k_bits);
        }
      }
      for (const auto& [name, book] :
           {std::pair{"k_codebook", &l.k_codebook}, std::pair{"v_codebook", &l.v_codebook}}) {
        if (!lj.contains(name)) continue;
        std::string raw;
        if (!lj.at(name).is_string() ||
            !absl::Base64Unescape(lj.at(name).get<std::string>(), &raw) || raw.size() % 2 != 0) {
          return Bad(absl::StrCat("layer ", i, " ", name, " is not base64 of 16-bit values"));
        }
        book->resize(raw.size() / 2);
        for (size_t e = 0; e < book->size(); ++e) {
          (*book)[e] = static_cast<uint16_t>(static_cast<uint8_t>(raw[2 * e]) |
                                             (static_cast<uint8_t>(raw[2 * e + 1]) << 8));
        }
        // Every codebook entry is a finite fp16 value.
        for (uint16_t h : *book) {
          if ((h & 0x7c00) == 0x7c00) {
            return Bad(absl::StrCat("layer ", i, " ", name, " holds a value that is not finite"));
          }
        }
        if (book->size() != layer_entries) {
          return Bad(absl::StrCat("layer ", i, " ", name, " has ", book->size(),
                                  " entries, not the ", layer_entries, " of codec ",
                                  l.spec.empty() ? c.codec : l.spec,
                                  " (kv_heads x head_dim x 2^b)"));
        }
      }
      for (const auto& [name, metric] :
           {std::pair{"k_metric", &l.k_metric}, std::pair{"v_metric", &l.v_metric}}) {
        if (!lj.contains(name)) continue;
        *metric = lj.at(name).get<std::vector<float>>();
        if (metric->size() != size_t{c.kv_heads} * c.head_dim) {
          return Bad(absl::StrCat("layer ", i, " ", name, " has ", metric->size(),
                                  " entries, not kv_heads x head_dim = ", c.kv_heads * c.head_dim));
        }
        for (float w : *metric) {
          if (!(w > 0.0f && std::isfinite(w))) {
            return Bad(absl::StrCat("layer ", i, " ", name, " holds ", w,
                                    ": every weight is finite and positive"));
          }
        }
      }
      for (const auto& [name, perm] : {std::pair{"k_perm", &l.k_perm}, std::pair{"v_perm", &l.v_perm}}) {
        if (perm->empty()) continue;
        if (perm->size() != size_t{c.kv_heads} * c.head_dim) {
          return Bad(absl::StrCat("layer ", i, " ", name, " has ", perm->size(),
                                  " entries, not kv_heads x head_dim = ", c.kv_heads * c.head_dim));
        }
        for (uint32_t h = 0; h < c.kv_heads; ++h) {
          std::vector<bool> seen(c.head_dim, false);
          for (uint32_t d = 0; d < c.head_dim; ++d) {
            const uint16_t p = (*perm)[size_t{h} * c.head_dim + d];
            if (p >= c.head_dim || seen[p]) {
              return Bad(absl::StrCat("layer ", i, " ", name, " head ", h,
                                      " is not a permutation of 0..", c.head_dim - 1));
            }
            seen[p] = true;
          }
        }
      }
      for (const auto& [name, clip] : {std::pair{"k_clip", l.k_clip}, std::pair{"v_clip", l.v_clip}}) {
        if (!(clip > 0.0f && clip <= 1.0f)) {
          return Bad(absl::StrCat("layer ", i, " ", name, " ", clip, " is not in (0, 1]"));
        }
      }
      if (!ValidBits(l.k_bits) || !ValidBits(l.v_bits)) {
        return Bad(absl::StrCat("layer ", i, " bits k", l.k_bits, "v", l.v_bits,
                                " must be 2, 3, 4, 8 or 0"));
      }
      c.layers.push_back(std::move(l));
    }
  } catch (const Json::exception& e) {
    return Bad(absl::StrCat("malformed field: ", e.what()));
  }
  return c;
}

absl::StatusOr<Calibration> Calibration::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("calibration: cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().size() > (64u << 20)) return Bad(absl::StrCat(path, " is larger than 64 MiB"));
  absl::StatusOr<Calibration> c = Parse(ss.str());
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

absl::Status Calibration::Save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << Serialize() << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("calibration: cannot write ", path));
  return absl::OkStatus();
}

std::vector<uint16_t> ChannelOrderByRange(const float* x, uint32_t tokens, uint32_t heads,
                                          uint32_t head_dim, uint32_t head) {
  std::vector<float> lo(head_dim, INFINITY), hi(head_dim, -INFINITY);
  for (uint32_t t = 0; t < tokens; ++t) {
    const float* row = x + (size_t{t} * heads + head) * head_dim;
    for (uint32_t d = 0; d < head_dim; ++d) {
      lo[d] = std::min(lo[d], row[d]);
      hi[d] = std::max(hi[d], row[d]);
    }
  }
  std::vector<uint16_t> perm(head_dim);
  std::iota(perm.begin(), perm.end(), uint16_t{0});
  std::stable_sort(perm.begin(), perm.end(), [&](uint16_t a, uint16_t b) {
    return hi[a] - lo[a] < hi[b] - lo[b];
  });
  return perm;
}

}  // namespace strata::kernels
