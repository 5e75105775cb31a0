#include "kernels/codec_spec.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
         id == CodecId::kGearL;
}

double CodecSpec::nominal_bits() const {
  if (id == CodecId::kInt8 || id == CodecId::kFp8E4M3) return 8;
  return (k_bits + v_bits) / 2.0;
}

absl::StatusOr<CodecSpec> CodecSpec::Parse(absl::string_view text) {
  const std::vector<absl::string_view> f = absl::StrSplit(text, ':');
  CodecSpec s;
  const absl::string_view name = f[0];
  auto no_fields = [&](CodecId id) -> absl::StatusOr<CodecSpec> {
    if (f.size() != 1) return Bad(text, absl::StrCat(name, " takes no parameters"));
    s.id = id;
    if (id == CodecId::kInt8 || id == CodecId::kFp8E4M3) s.k_bits = s.v_bits = 8;
    return s;
  };
  if (name == "fp16") return no_fields(CodecId::kFp16);
  if (name == "bf16") return no_fields(CodecId::kBf16);
  if (name == "int8") return no_fields(CodecId::kInt8);
  if (name == "fp8e4m3") return no_fields(CodecId::kFp8E4M3);

  if (name == "kivi") {
    s.id = CodecId::kKivi;
  } else if (name == "kcvt") {
    s.id = CodecId::kKcvt;
  } else if (name == "gear") {
    s.id = CodecId::kGear;
  } else if (name == "gearl") {
    s.id = CodecId::kGearL;
  } else {
    return Bad(text, absl::StrCat("unknown codec '", name,
                                  "' (known: fp16, bf16, int8, fp8e4m3, kivi, kcvt, gear, gearl)"));
  }
  size_t i = 1;
  if (i >= f.size() || !ParseBits(f[i], &s.k_bits, &s.v_bits)) {
    return Bad(text, "second field must be the bits, e.g. k2v2");
  }
  if (!ValidBits(s.k_bits) || !ValidBits(s.v_bits)) {
    return Bad(text, absl::StrCat("bits must be 2, 3, 4 or 8, not k", s.k_bits, "v", s.v_bits));
  }
  ++i;
  if (s.id == CodecId::kKcvt) {
    s.group = 0;
  } else {
    if (i >= f.size()) return Bad(text, "missing the group field (gN, or kcvt)");
    if (f[i] == "kcvt" && s.id != CodecId::kKivi) {
      s.group = 0;
    } else if (!ParseIntField(f[i], 'g', &s.group) || s.group < 8 || s.group > 4096 ||
               s.group % 8 != 0) {
      return Bad(text, absl::StrCat("group '", f[i], "' must be gN with N a multiple of 8 in ",
                                    "[8, 4096]", s.id == CodecId::kKivi ? "" : ", or kcvt"));
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
  if (i != f.size()) return Bad(text, absl::StrCat("unexpected field '", f[i], "'"));
  return s;
}

std::string CodecSpec::ToString() const {
  if (!is_affine()) return CodecIdName(id);  // fp16, bf16, int8, fp8e4m3: no parameters
  std::vector<std::string> f = {CodecIdName(id), absl::StrCat("k", k_bits, "v", v_bits)};
  if (id == CodecId::kKcvt) return absl::StrJoin(f, ":");
  f.push_back(group == 0 ? "kcvt" : absl::StrCat("g", group));
  if (id == CodecId::kGear || id == CodecId::kGearL) {
    f.push_back(absl::StrCat("r", rank));
    if (id == CodecId::kGear) f.push_back(absl::StrCat("s", outlier_percent));
    if (power_iterations != kDefaultPowerIterations) {
      f.push_back(absl::StrCat("i", power_iterations));
    }
  }
  return absl::StrJoin(f, ":");
}

}  // namespace strata::kernels
