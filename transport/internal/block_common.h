// What the block protocol's receiver and sender both use: their message handlers' installation
// and the sending of their control messages (private to transport/).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "transport/block_protocol.h"
#include "transport/transport.h"

namespace strata::transport::internal {

// A protocol side's message handlers: installed from one list and uninstalled from the same.
template <typename Impl>
using HandlerList = std::vector<std::pair<uint16_t, void (Impl::*)(IncomingMessage&)>>;

template <typename Impl>
void InstallHandlers(Transport* transport, const std::shared_ptr<Impl>& impl,
                     const HandlerList<Impl>& handlers) {
  for (const auto& handler : handlers) {
    // (Not a structured binding: clang before 16 cannot capture one, and the fuzzers build with
    // clang.)
    transport->SetHandler(handler.first, [weak = std::weak_ptr<Impl>(impl),
                                          method = handler.second](IncomingMessage& m) {
      if (auto self = weak.lock()) ((*self).*method)(m);
    });
  }
}

template <typename Impl>
void UninstallHandlers(Transport* transport, const HandlerList<Impl>& handlers) {
  for (const auto& [id, method] : handlers) transport->SetHandler(id, nullptr);
}

template <typename Fn>
void SendMessage(const std::shared_ptr<Endpoint>& ep, uint16_t id, const std::string& h,
                 Fn done) {
  ep->Send(id, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.data()), h.size()),
           {}, absl::Seconds(30), std::move(done));
}

inline void SendRelease(const std::shared_ptr<Endpoint>& ep, uint16_t id, RingRelease r) {
  if (ep == nullptr) return;
  SendMessage(ep, id, EncodeRingRelease(r), [](absl::Status) {});
}

}  // namespace strata::transport::internal
