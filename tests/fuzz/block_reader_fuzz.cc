// libFuzzer target for the block reader: whatever the bytes, BlockView::Parse must return a
// Status or a view whose every section lies inside the input, never crash or read out of
// bounds; and any block it accepts must be one the writer could have produced.
//
// A custom mutator reseals the CRC-32C of half the mutants so that the fuzzer also explores
// what happens after a checksum passes.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/block_reader.h"
#include "common/block_writer.h"
#include "common/crc32c.h"
#include "common/endian.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  if ((seed & 1) && size >= 16) {
    // Keep the declared total consistent with the buffer sometimes, then reseal.
    if (seed & 2) strata::StoreLE<uint32_t>(data + 12, static_cast<uint32_t>(size));
    strata::StoreLE<uint32_t>(data + 4, strata::Crc32c(data + 8, size - 8));
  }
  return size;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Span<const uint8_t> in(data, size);
  for (bool verify : {true, false}) {
    absl::StatusOr<strata::BlockView> v =
        strata::BlockView::Parse(in, strata::ParseOptions{.verify_checksum = verify});
    if (!v.ok()) {
      if (v.status().message().empty()) __builtin_trap();  // every error must say why
      continue;
    }
    uint32_t sum = 0;
    std::vector<strata::SectionDesc> descs;
    for (const strata::SectionView& s : v->sections()) {
      if (s.data.data() < data || s.data.data() + s.data.size() > data + size) __builtin_trap();
      for (uint8_t b : s.data) sum += b;  // touch every byte: ASan checks the bounds
      descs.push_back(
          {s.entry.kind, s.entry.tensor, s.entry.elem, s.entry.count, s.entry.alignment});
    }
    (void)sum;
    // The writer must accept what the reader accepted, and place it the same way.
    absl::StatusOr<strata::BlockLayout> layout = strata::BlockLayout::Plan(v->header(), descs);
    if (!layout.ok() || layout->total_bytes() != size) __builtin_trap();
    for (int i = 0; i < layout->section_count(); ++i) {
      if (layout->section(i).offset != v->section(i).entry.offset) __builtin_trap();
    }
  }
  return 0;
}
