#include "kernels/codec_spec.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace strata::kernels {
namespace {

absl::Status Bad(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("codec spec '", text, "': ", why));
}

bool ValidBits(int b) { return b == 2 || b == 3 || b == 4 || b == 8; }

// "k2v4" -> (2, 4)
bool ParseBits(absl::string_view f, int* k, int* v) {
  if (f.size() < 4 || f[0] != 'k') return false;
  const size_t vpos = f.find('v');
  if (vpos == absl::string_view::npos) return false;
  return absl::SimpleAtoi(f.substr(1, vpos - 1), k) && absl::SimpleAtoi(f.substr(vpos + 1), v);
}

bool ParseIntField(absl::string_view f, char prefix, int* out) {
  return f.size() >= 2 && f[0] == prefix && absl::SimpleAtoi(f.substr(1), out);
}

}  // namespace

bool CodecSpec::is_affine() const {
  return id == CodecId::kKivi || id == CodecId::kKcvt || id == CodecId::kGear ||
         id == CodecId::kGearL || id == CodecId::kZipCache || id == CodecId::kSkvq ||
         id == CodecId::kTada;
}

uint32_t CodecSpec::SalientTokens(uint32_t tokens) const {
  if (salient_percent <= 0) return 0;
  const double n = std::floor(tokens * salient_percent / 100.0 + 0.5);
  return static_cast<uint32_t>(std::min<double>(tokens, std::max(1.0, n)));
}

std::vector<CodecSpec> CodecSpec::PartSpecs() const {
  std::vector<CodecSpec> out;
  CodecSpec plain = *this;
  plain.sink_tokens = 0;
  plain.rotate = false;  // a cache-level stage: parts encode what they are given
  if (sink_tokens > 0) {
    CodecSpec fp;
    fp.id = CodecId::kFp16;
    out.push_back(fp);
  }
  if (id == CodecId::kZipCache && salient_percent > 0) {
    plain.salient_percent = 0;
    CodecSpec hi = plain;
    hi.k_bits = hi.v_bits = hi_bits;
    hi.hi_bits = 0;
    out.push_back(hi);
    plain.hi_bits = 0;
  }
  out.push_back(plain);
  return out;
}

double CodecSpec::nominal_bits() const {
  if (id == CodecId::kInt8 || id == CodecId::kFp8E4M3) return 8;
  if (id == CodecId::kCq) return static_cast<double>(k_bits) / group;
  return (k_bits + v_bits) / 2.0;
}

absl::StatusOr<CodecSpec> CodecSpec::Parse(absl::string_view text) {
  const std::vector<absl::string_view> f = absl::StrSplit(text, ':');
  CodecSpec s;
  const absl::string_view name = f[0];
  // The trailing options every quantizing codec takes, from field i on.
  auto options = [&](size_t i) -> absl::StatusOr<CodecSpec> {
    if (i < f.size() && f[i] == "m8") {
      if (!s.is_affine()) return Bad(text, "m8 (fp8 scales) is for the affine codecs");
      s.fp8_meta = true;
      ++i;
    }
    if (i < f.size() && f[i] == "rot") {
      if (s.id == CodecId::kFp16 || s.id == CodecId::kBf16) {
        return Bad(text, "rot is for quantizing codecs (fp16/bf16 lose nothing to rotate away)");
      }
      if (s.needs_calibration()) {
        return Bad(text,
                   "rot is not for calibrated codecs yet (their calibration reads unrotated "
                   "K and V)");
      }
      s.rotate = true;
      ++i;
    }
    if (i < f.size() && absl::StartsWith(f[i], "sink")) {
      if (s.id == CodecId::kFp16 || s.id == CodecId::kBf16) {
        return Bad(text, "sinks are for quantizing codecs (fp16/bf16 keep every token)");
      }
      if (!absl::SimpleAtoi(f[i].substr(4), &s.sink_tokens) || s.sink_tokens < 1 ||
          s.sink_tokens > 1024) {
        return Bad(text, "sinkN needs N in [1, 1024]");
      }
      ++i;
    }
    if (i != f.size()) return Bad(text, absl::StrCat("unexpected field '", f[i], "'"));
    return s;
  };
  auto no_fields = [&](CodecId id) -> absl::StatusOr<CodecSpec> {
    s.id = id;
    if (id == CodecId::kInt8 || id == CodecId::kFp8E4M3) s.k_bits = s.v_bits = 8;
    if (f.size() > 1 && !absl::StartsWith(f[1], "sink") && f[1] != "rot") {
      return Bad(text, absl::StrCat(name, " takes no parameters but rot and sinkN"));
    }
    return options(1);
  };
  if (name == "fp16") return no_fields(CodecId::kFp16);
  if (name == "bf16") return no_fields(CodecId::kBf16);
  if (name == "int8") return no_fields(CodecId::kInt8);
  if (name == "fp8e4m3") return no_fields(CodecId::kFp8E4M3);

  if (name == "cq") {
    s.id = CodecId::kCq;
    if (f.size() < 3 || !ParseIntField(f[1], 'c', &s.group) ||
        (s.group != 2 && s.group != 4 && s.group != 8)) {
      return Bad(text,
                 "cq needs the channels coupled, c2, c4 or c8, then the codebook bits, e.g. "
                 "cq:c4:b6");
    }
    if (!ParseIntField(f[2], 'b', &s.k_bits) || s.k_bits < 4 || s.k_bits > 8) {
      return Bad(text, "cq's codebook bits bN need N in 4..8 (2^N centroids), e.g. cq:c4:b6");
    }
    s.v_bits = s.k_bits;
    size_t i = 3;
    if (i < f.size() && f[i] == "norm") {
      s.token_norm = true;
      ++i;
    }
    return options(i);
  }
  if (name == "kivi") {
    s.id = CodecId::kKivi;
  } else if (name == "kcvt") {
    s.id = CodecId::kKcvt;
  } else if (name == "gear") {
    s.id = CodecId::kGear;
  } else if (name == "gearl") {
    s.id = CodecId::kGearL;
  } else if (name == "zipcache") {
    s.id = CodecId::kZipCache;
  } else if (name == "skvq") {
    s.id = CodecId::kSkvq;
  } else if (name == "tada") {
    s.id = CodecId::kTada;
  } else if (name == "strata") {
    s.id = CodecId::kStrata;
    if (f.size() != 2 || f[1].size() < 2 || f[1][0] != 'b' ||
        !absl::SimpleAtod(f[1].substr(1), &s.budget_bits) || !(s.budget_bits >= 1.5) ||
        s.budget_bits > 16) {
      return Bad(text, "strata takes one field bX, the bits per element in [1.5, 16], e.g. b3");
    }
    s.k_bits = s.v_bits = 0;
    return s;
  } else {
    return Bad(text, absl::StrCat("unknown codec '", name,
                                  "' (known: fp16, bf16, int8, fp8e4m3, kivi, kcvt, gear, gearl, "
                                  "zipcache, skvq, tada, cq, strata)"));
  }
  size_t i = 1;
  if (i >= f.size() || !ParseBits(f[i], &s.k_bits, &s.v_bits)) {
    return Bad(text, "second field must be the bits, e.g. k2v2");
  }
  if (!ValidBits(s.k_bits) || !ValidBits(s.v_bits)) {
    return Bad(text, absl::StrCat("bits must be 2, 3, 4 or 8, not k", s.k_bits, "v", s.v_bits));
  }
  ++i;
  if (s.id == CodecId::kZipCache) {
    s.group = 0;
    if (i >= f.size() || !ParseIntField(f[i], 'h', &s.hi_bits) || !ValidBits(s.hi_bits) ||
        s.hi_bits <= std::max(s.k_bits, s.v_bits)) {
      return Bad(text, "needs the salient bits hN (2, 3, 4 or 8) above the k/v bits, e.g. h4");
    }
    ++i;
    if (i >= f.size() || f[i].size() < 2 || f[i][0] != 's' ||
        !absl::SimpleAtod(f[i].substr(1), &s.salient_percent) || !(s.salient_percent > 0) ||
        s.salient_percent >= 100) {
      return Bad(text, "needs the salient share sX with X the percent in (0, 100), e.g. s10");
    }
    ++i;
    if (i < f.size() && f[i].size() >= 2 && f[i][0] == 'p') {
      if (!absl::SimpleAtod(f[i].substr(1), &s.probe_percent) || !(s.probe_percent > 0) ||
          s.probe_percent > 50) {
        return Bad(text, "probe share pX needs X in (0, 50]");
      }
      ++i;
    }
    return options(i);
  }
  if (s.id == CodecId::kKcvt) {
    s.group = 0;
  } else {
    if (i >= f.size()) return Bad(text, "missing the group field (gN, or kcvt)");
    if (f[i] == "kcvt" && s.id != CodecId::kKivi && s.id != CodecId::kSkvq) {
      s.group = 0;
    } else if (!ParseIntField(f[i], 'g', &s.group) || s.group < 8 || s.group > 4096 ||
               s.group % 8 != 0) {
      return Bad(text, absl::StrCat("group '", f[i], "' must be gN with N a multiple of 8 in ",
                                    "[8, 4096]",
                                    s.id == CodecId::kKivi || s.id == CodecId::kSkvq ? ""
                                                                                     : ", or kcvt"));
    }
    ++i;
  }
  if (s.id == CodecId::kGear || s.id == CodecId::kGearL) {
    if (i >= f.size() || !ParseIntField(f[i], 'r', &s.rank) || s.rank < 1 || s.rank > 64) {
      return Bad(text, "needs a rank field rN with N in [1, 64]");
    }
    ++i;
    if (s.id == CodecId::kGear) {
      if (i >= f.size() || f[i].size() < 2 || f[i][0] != 's' ||
          !absl::SimpleAtod(f[i].substr(1), &s.outlier_percent) || !(s.outlier_percent > 0) ||
          s.outlier_percent > 50) {
        return Bad(text, "needs an outlier field sX with X the percent in (0, 50], e.g. s2");
      }
      ++i;
    }
    if (i < f.size() && !f[i].empty() && f[i][0] == 'i') {
      if (!ParseIntField(f[i], 'i', &s.power_iterations) || s.power_iterations < 1 ||
          s.power_iterations > 32) {
        return Bad(text, "power iterations iN need N in [1, 32]");
      }
      ++i;
    }
  }
  return options(i);
}

std::string CodecSpec::ToString() const {
  if (id == CodecId::kStrata) return absl::StrCat("strata:b", budget_bits);
  std::vector<std::string> f = {CodecIdName(id)};
  const std::string sinks = absl::StrCat(fp8_meta ? ":m8" : "", rotate ? ":rot" : "",
                                         sink_tokens > 0 ? absl::StrCat(":sink", sink_tokens) : "");
  if (id == CodecId::kCq) {
    return absl::StrCat("cq:c", group, ":b", k_bits, token_norm ? ":norm" : "", sinks);
  }
  if (!is_affine()) return absl::StrCat(f[0], sinks);  // fp16, bf16, int8, fp8e4m3
  f.push_back(absl::StrCat("k", k_bits, "v", v_bits));
  if (id == CodecId::kZipCache) {
    // A part spec (salient_percent 0) prints as its bits only; it never appears in a header.
    if (salient_percent > 0) {
      f.push_back(absl::StrCat("h", hi_bits));
      f.push_back(absl::StrCat("s", salient_percent));
      if (probe_percent != 5) f.push_back(absl::StrCat("p", probe_percent));
    }
    return absl::StrCat(absl::StrJoin(f, ":"), sinks);
  }
  if (id == CodecId::kKcvt) return absl::StrCat(absl::StrJoin(f, ":"), sinks);
  f.push_back(group == 0 ? "kcvt" : absl::StrCat("g", group));
  if (id == CodecId::kGear || id == CodecId::kGearL) {
    f.push_back(absl::StrCat("r", rank));
    if (id == CodecId::kGear) f.push_back(absl::StrCat("s", outlier_percent));
    if (power_iterations != kDefaultPowerIterations) {
      f.push_back(absl::StrCat("i", power_iterations));
    }
  }
  return absl::StrCat(absl::StrJoin(f, ":"), sinks);
}

}  // namespace strata::kernels
