// KvShipment: what one prefill request sends its decode node (transport/shipment.h names each
// piece), in order: blocks (the adopted prefix, then each computed layer's as soon as it is
// compressed), each layer's window, then the end with the first token. Every payload stays alive
// here until its transfer completes; the counts go to the request's result.
//
//   KvShipment ship(sender, peer, request_id);
//   ship.Block(layer, chunk, name, parent, bytes, fp16_bytes);   // any number, any order
//   if (!ship.error().ok()) return ship.Abort(ship.error());      // a send that failed at once
//   ship.Window(layer, cache->ExportWindow(layer));              // every layer
//   ship.End(end);
//   STRATA_RETURN_IF_ERROR(ship.Finish());                       // acknowledged, or aborted
//
// Not thread-safe: one request's thread uses it. The destructor cancels and waits for what is
// still in flight (after Finish or Abort nothing is).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/prefix_key.h"
#include "common/shared_bytes.h"
#include "transport/block_protocol.h"
#include "transport/shipment.h"

namespace strata::prefill {

class KvShipment {
 public:
  // `sender` and `peer` outlive the shipment.
  KvShipment(transport::BlockSender* sender, std::shared_ptr<transport::Endpoint> peer,
             std::string request_id);
  ~KvShipment();
  KvShipment(const KvShipment&) = delete;
  KvShipment& operator=(const KvShipment&) = delete;

  // One block (its store `name`, the parent chunk's key unless it is the first); `fp16_bytes`:
  // what its K and V would be at fp16 (for the compression figures). Returns its transfer's
  // index, for Acknowledged.
  size_t Block(uint32_t layer, uint32_t chunk, BlockName name, std::optional<BlockHash> parent,
               SharedBytes bytes, uint64_t fp16_bytes);
  void Window(uint32_t layer, std::string window);
  void End(const transport::ShipmentEnd& end);

  // The first failure of a send so far (OK while none failed): the request should stop.
  const absl::Status& error() const { return error_; }
  // Whether transfer `index` (Block's answer) completed and the decode node acknowledged it.
  bool Acknowledged(size_t index) const;
  // Waits for every transfer; on the first failure aborts (below) and returns it.
  absl::Status Finish();
  // Cancels what is in flight, waits for it, and tells the decode node to drop the request (best
  // effort, 2 s). Returns `why`.
  absl::Status Abort(const absl::Status& why);

  uint32_t blocks() const { return blocks_; }
  uint64_t bytes() const { return bytes_; }              // payloads and shipment ids
  uint64_t block_bytes() const { return block_bytes_; }  // of which compressed blocks
  uint64_t fp16_bytes() const { return fp16_bytes_; }

 private:
  void Send(const transport::ShipmentId& id, std::shared_ptr<const std::string> text);
  void Send(const transport::ShipmentId& id, SharedBytes bytes);
  void Track(std::shared_ptr<transport::Transfer> t);

  transport::BlockSender* const sender_;
  const std::shared_ptr<transport::Endpoint> peer_;
  const std::string request_id_;
  std::vector<std::shared_ptr<transport::Transfer>> transfers_;
  std::vector<SharedBytes> blocks_kept_;  // payloads of transfers_
  std::vector<std::shared_ptr<const std::string>> texts_kept_;
  absl::Status error_;
  uint32_t blocks_ = 0;
  uint64_t bytes_ = 0, block_bytes_ = 0, fp16_bytes_ = 0;
};

}  // namespace strata::prefill
