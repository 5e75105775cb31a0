#include "common/host_port.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace strata {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port (", why,
                                                   "; e.g. 127.0.0.1:7101 or [::1]:7101)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return bad("no port");
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port_text = address.substr(colon + 1);
  if (!host.empty() && host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return bad("an unclosed '['");
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != absl::string_view::npos) {
    return bad("an IPv6 host needs brackets");
  }
  if (host.empty()) return bad("no host");
  uint32_t port = 0;
  if (port_text.empty() || !absl::SimpleAtoi(port_text, &port) || port > 65535) {
    return bad("the port is not a number in 0..65535");
  }
  return HostPort{std::string(host), static_cast<uint16_t>(port)};
}

std::string JoinHostPort(absl::string_view host, uint16_t port) {
  if (host.find(':') != absl::string_view::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

}  // namespace strata
