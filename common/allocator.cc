#include "common/allocator.h"

#include <dlfcn.h>

#include <cstddef>

namespace strata {

std::string AllocatorName() {
  // jemalloc's control interface, looked up rather than linked: this library does not decide
  // which malloc its programs use.
  using Mallctl = int (*)(const char*, void*, size_t*, void*, size_t);
  auto mallctl = reinterpret_cast<Mallctl>(dlsym(RTLD_DEFAULT, "mallctl"));
  if (mallctl == nullptr) return "system malloc";
  const char* version = nullptr;
  size_t size = sizeof(version);
  if (mallctl("version", &version, &size, nullptr, 0) != 0 || version == nullptr) {
    return "jemalloc";
  }
  std::string v(version);  // "5.3.0-0-g<commit>": the release is enough
  if (const size_t dash = v.find('-'); dash != std::string::npos) v.resize(dash);
  return "jemalloc " + v;
}

}  // namespace strata
