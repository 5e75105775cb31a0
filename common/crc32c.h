// CRC-32C (Castagnoli; iSCSI, RFC 3720), the checksum of every Strata block.
//
// Crc32c uses the CPU's SSE4.2 crc32 instruction when present (runtime dispatch), three streams
// interleaved to hide its latency, and a slicing-by-8 table implementation otherwise; both give
// identical results. Crc32cCombine joins the checksums of two adjacent pieces so that large
// buffers (or sections written by different threads or devices) can be checksummed in parallel.
// Thread safety: all functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// CRC-32C of n bytes.
uint32_t Crc32c(const void* data, size_t n);

// The CRC-32C of (A || B) given crc = Crc32c(A) and the bytes of B. Crc32cExtend(0, B, n) ==
// Crc32c(B).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

// The CRC-32C of (A || B) given Crc32c(A), Crc32c(B) and the length of B. O(log len_b).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, size_t len_b);

// The table implementation, exposed so tests and benchmarks can hold the two paths together.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);

// True when Crc32c uses the SSE4.2 instruction.
bool Crc32cIsHardwareAccelerated();

}  // namespace strata
