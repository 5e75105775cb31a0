// UTF-8 validation (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
#pragma once

#include "absl/strings/string_view.h"

namespace strata {

// True when `s` is well-formed UTF-8. Sets *error_offset (when given) to the first bad byte.
bool IsValidUtf8(absl::string_view s, size_t* error_offset = nullptr);

}  // namespace strata
