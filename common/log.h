// The one logger of Strata's processes: a line per event on stderr,
//   "2026-11-25T10:00:00.123Z strata-decode decode-0 [req-id] message"
// with the process and node set once at start (SetLogIdentity). Libraries (the engines, the
// store, the router's HTTP server) and mains log through it, so every line of a process has one
// shape and lines from different threads never interleave.
//
// Thread-safe: one write per line, under one lock.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace strata {

// One line; `request_id` may be empty.
void Log(absl::string_view request_id, absl::string_view message);

// Sets the process name and node id Log prefixes every line with (default: "strata", none).
void SetLogIdentity(std::string process, std::string node_id);

}  // namespace strata
