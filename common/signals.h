// How Strata's processes stop: SIGTERM and SIGINT are blocked in every thread from the start of
// main and taken by the main thread when it is ready for them (sigwait), so no handler runs on an
// arbitrary thread and nothing but the main thread ever sees them. The nodes, the router and the
// store all stop this way.
//
//   int main() {
//     strata::BlockTerminationSignals();  // first, before any thread exists
//     ... start serving ...
//     const int sig = strata::WaitForTermination();
//     ... drain, stop ...
//   }
#pragma once

#include "absl/time/time.h"

namespace strata {

// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts later: call it
// first in main, before any thread exists. Then WaitForTermination() returns the signal.
void BlockTerminationSignals();
int WaitForTermination();
// The same for at most `timeout`: the signal, or 0.
int WaitForTerminationFor(absl::Duration timeout);

}  // namespace strata
