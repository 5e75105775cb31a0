#include "model/served_format.h"

#include "common/status_macros.h"
#include "kernels/codec.h"

namespace strata::model {

absl::Status ServedFormat::Validate() const {
  STRATA_RETURN_IF_ERROR(kernels::CodecSpec::Parse(codec).status());
  return KeysFor("").Validate();
}

}  // namespace strata::model
