// libFuzzer target for the model-file parsers: the input is taken as a whole safetensors file
// (u64 header length, JSON header, data), as config.json text, and as tokenizer.json text (a
// tokenizer that loads must then encode and decode without crashing). Any input must yield a
// Status or a table of tensors that all lie inside the data area, never a crash.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/endian.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  (void)strata::model::ParseModelConfig(text);
  auto tok = strata::model::Tokenizer::FromJson(text);
  if (tok.ok()) {
    const std::vector<uint32_t> ids = (*tok)->Encode("Hello world  12345 \xc3\xa9\n<|x|>");
    (void)(*tok)->Decode(ids);
  }
  if (size < 8) return 0;
  const uint64_t header = strata::LoadLE<uint64_t>(data);
  if (header > size - 8) return 0;
  const uint64_t data_bytes = size - 8 - header;
  auto tensors = strata::model::ParseSafetensorsHeader(text.substr(8, header), data_bytes);
  if (!tensors.ok()) return 0;
  for (const strata::model::TensorInfo& t : *tensors) {
    if (t.begin + t.bytes > data_bytes) __builtin_trap();
    if (static_cast<uint64_t>(t.numel()) * strata::model::TensorDTypeBytes(t.dtype) != t.bytes) {
      __builtin_trap();
    }
  }
  return 0;
}
