// The message handlers a backend dispatches to, by id (private to transport/).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "transport/transport.h"

namespace strata::transport::internal {

// What Send answers for a message id no backend carries.
inline absl::Status CheckMessageId(uint16_t id) {
  if (id <= kMaxMessageId) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("message id ", id, " is out of range (0..", kMaxMessageId, ")"));
}

class HandlerTable {
 public:
  // Installs (or, for an empty handler, removes) the handler for `id`. Ids above kMaxMessageId
  // are ignored: no backend sends them.
  void Set(uint16_t id, MessageHandler h) {
    if (id > kMaxMessageId) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (h) {
      handlers_[id] = std::make_shared<MessageHandler>(std::move(h));
    } else {
      handlers_.erase(id);
    }
  }

  // The handler for `id`, or null (the message is dropped). Shared: replacing it while a
  // message is being handled is safe.
  std::shared_ptr<MessageHandler> Get(uint16_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handlers_.find(id);
    return it == handlers_.end() ? nullptr : it->second;
  }

  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    handlers_.clear();
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<uint16_t, std::shared_ptr<MessageHandler>> handlers_;
};

}  // namespace strata::transport::internal
