// `strata inspect FILE`: prints a block's header and section table.
#pragma once

#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace strata::tools {

// Reads the block in `path` and prints it to `out`. Returns the parse error when the file is not
// a valid block (after printing as much as can be shown safely: for a block that fails only its
// checksum, the header and sections are still printed, marked as unverified). The header is read
// first: a file that is not a block (kInvalidArgument), or whose size is not the one its header
// declares (kDataLoss, both sizes in the message), is refused without reading the rest.
absl::Status InspectBlockFile(const std::string& path, std::ostream& out);

}  // namespace strata::tools
