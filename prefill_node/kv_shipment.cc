#include "prefill_node/kv_shipment.h"

#include <utility>

namespace strata::prefill {
namespace {

transport::Payload PayloadOf(const uint8_t* data, size_t size) {
  return {.bytes = std::span<const uint8_t>(data, size)};
}

}  // namespace

KvShipment::KvShipment(transport::BlockSender* sender, std::shared_ptr<transport::Endpoint> peer,
                       std::string request_id)
    : sender_(sender), peer_(std::move(peer)), request_id_(std::move(request_id)) {}

KvShipment::~KvShipment() {
  // The payloads must outlive their transfers.
  for (auto& t : transfers_) {
    if (!t->done()) t->Cancel();
  }
  for (auto& t : transfers_) t->Wait().IgnoreError();
}

void KvShipment::Track(std::shared_ptr<transport::Transfer> t) {
  if (t->done() && !t->status().ok() && error_.ok()) error_ = t->status();
  transfers_.push_back(std::move(t));
}

void KvShipment::Send(const transport::ShipmentId& id, SharedBytes bytes) {
  const std::string encoded = id.Encode();
  bytes_ += encoded.size() + bytes.size();
  Track(sender_->Send(peer_, encoded, PayloadOf(bytes.span().data(), bytes.size())));
  blocks_kept_.push_back(std::move(bytes));
}

void KvShipment::Send(const transport::ShipmentId& id, std::shared_ptr<const std::string> text) {
  const std::string encoded = id.Encode();
  bytes_ += encoded.size() + text->size();
  Track(sender_->Send(peer_, encoded,
                      PayloadOf(reinterpret_cast<const uint8_t*>(text->data()), text->size())));
  texts_kept_.push_back(std::move(text));
}

size_t KvShipment::Block(uint32_t layer, uint32_t chunk, BlockName name,
                         std::optional<BlockHash> parent, SharedBytes bytes, uint64_t fp16_bytes) {
  transport::ShipmentId id{.kind = transport::ShipmentKind::kBlock,
                           .request_id = request_id_,
                           .layer = layer,
                           .chunk = chunk,
                           .name = std::move(name)};
  if (parent.has_value()) id.parent_key = *parent;
  block_bytes_ += bytes.size();
  fp16_bytes_ += fp16_bytes;
  ++blocks_;
  Send(id, std::move(bytes));
  return transfers_.size() - 1;
}

void KvShipment::Window(uint32_t layer, std::string window) {
  Send({.kind = transport::ShipmentKind::kWindow, .request_id = request_id_, .layer = layer},
       std::make_shared<const std::string>(std::move(window)));
}

void KvShipment::End(const transport::ShipmentEnd& end) {
  Send({.kind = transport::ShipmentKind::kEnd, .request_id = request_id_},
       std::make_shared<const std::string>(end.Encode()));
}

bool KvShipment::Acknowledged(size_t index) const {
  return index < transfers_.size() && transfers_[index]->done() && transfers_[index]->status().ok();
}

absl::Status KvShipment::Finish() {
  for (auto& t : transfers_) {
    absl::Status s = t->Wait();
    if (!s.ok()) return Abort(s);
  }
  return absl::OkStatus();
}

absl::Status KvShipment::Abort(const absl::Status& why) {
  for (auto& t : transfers_) t->Cancel();
  for (auto& t : transfers_) t->Wait().IgnoreError();
  const std::string reason(why.message());
  transport::ShipmentId id{.kind = transport::ShipmentKind::kAbort, .request_id = request_id_};
  auto t = sender_->Send(peer_, id.Encode(),
                         PayloadOf(reinterpret_cast<const uint8_t*>(reason.data()), reason.size()),
                         {.timeout = absl::Seconds(2)});
  t->Wait().IgnoreError();  // best effort: the decode node also gives the request up
  return why;
}

}  // namespace strata::prefill
