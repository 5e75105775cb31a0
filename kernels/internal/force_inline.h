// Internal to kernels/: STRATA_FORCE_INLINE, the attribute that folds the SIMD helpers into their
// loops. Optimized builds need it (a __m256 helper left out of line costs a spill per call).
// Sanitizer builds get plain `inline`: GCC's instrumentation of the fully inlined attention kernels
// took 8.5 minutes and 10 GB for decode_attention_avx2.cc alone under ASan+UBSan (2.7 minutes
// without forced inlining), and the checks are the same either way.
#pragma once

// GCC says __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__; clang answers __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STRATA_SANITIZED_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define STRATA_SANITIZED_BUILD 1
#endif
#endif

#ifdef STRATA_SANITIZED_BUILD
#define STRATA_FORCE_INLINE
#else
#define STRATA_FORCE_INLINE __attribute__((always_inline))
#endif
