// libFuzzer target for calibration files (kernels/calibration.h: JSON with base64 codebooks), which
// nodes load from disk: any bytes are refused with a message or parsed into a calibration that
// serializes and parses back to itself.
#include <cstddef>
#include <cstdint>

#include "kernels/calibration.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::kernels::Calibration;
  absl::StatusOr<Calibration> c =
      Calibration::Parse(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!c.ok()) {
    if (c.status().message().empty()) __builtin_trap();
    return 0;
  }
  absl::StatusOr<Calibration> again = Calibration::Parse(c->Serialize());
  if (!again.ok() || !(*again == *c) || again->fingerprint() != c->fingerprint()) __builtin_trap();
  return 0;
}
