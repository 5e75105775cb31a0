// UTF-8 validation (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF) and
// repair of byte streams that are not (generated text: a byte-level model can emit any byte).
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace strata {

// True when `s` is well-formed UTF-8. Sets *error_offset (when given) to the first bad byte.
bool IsValidUtf8(absl::string_view s, size_t* error_offset = nullptr);

// U+FFFD REPLACEMENT CHARACTER, in UTF-8.
inline constexpr absl::string_view kUtf8Replacement = "\xEF\xBF\xBD";

// Appends `in` to *out as well-formed UTF-8: each maximal ill-formed subpart is replaced by one
// U+FFFD (Unicode's recommended practice, as Python's errors="replace" and WHATWG decoders do).
// When `final` is false, a sequence at the end of `in` that is incomplete but could still become a
// character is left unconsumed (its bytes may arrive later). Returns the bytes of `in` consumed.
size_t AppendUtf8Replacing(absl::string_view in, bool final, std::string* out);

}  // namespace strata
