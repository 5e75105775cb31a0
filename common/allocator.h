// Which malloc this process runs on, for logs and benchmark records.
//
// The service's programs and benchmarks link jemalloc (CMake's STRATA_ALLOCATOR, default
// "jemalloc"; see cmake/StrataHelpers.cmake, strata_use_allocator). A block of 256 KiB or 1 MiB
// is past glibc's mmap threshold: every one glibc allocates is a fresh mapping, faulted in page
// by page as bytes arrive and unmapped when freed. jemalloc keeps freed extents for reuse (and
// returns them to the system after its decay time), which doubled the shared tier's gets on a
// VM (bench/results/shared_tier_bench-*-2026-11-29-*.txt). Sanitized and fuzzing builds keep the
// system's malloc, which their runtimes replace.
//
//   Log("", absl::StrCat("allocator: ", strata::AllocatorName()));  // "jemalloc 5.3.0"
#pragma once

#include <string>

namespace strata {

// "jemalloc <version>" when jemalloc serves malloc in this process, else "system malloc".
std::string AllocatorName();

}  // namespace strata
