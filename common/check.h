// STRATA_CHECK for programmer errors (broken preconditions inside the process). Never use it on
// bytes from disk or the network: those get an absl::Status. STRATA_DCHECK compiles away in
// NDEBUG builds.
#pragma once

namespace strata::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const char* message);
}  // namespace strata::internal

#define STRATA_CHECK(cond, message)                                          \
  do {                                                                       \
    if (__builtin_expect(!(cond), 0)) {                                      \
      ::strata::internal::CheckFailed(__FILE__, __LINE__, #cond, (message)); \
    }                                                                        \
  } while (false)

#ifdef NDEBUG
#define STRATA_DCHECK(cond, message) \
  do {                               \
  } while (false && (cond))
#else
#define STRATA_DCHECK(cond, message) STRATA_CHECK(cond, message)
#endif
