// FaultInjectingTransport: a test seam, not a product part. Decorates the receiving side of a
// Transport: flips one byte of a block payload after the backend has landed it (corruption on
// the wire or in a DMA), or drops a message entirely (a lost message). Everything else goes to
// the real backend. Used by the transport conformance suite and the serving tests (a block
// damaged on its way from a prefill to a decode node is refused and sent again).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/block_protocol.h"
#include "transport/transport.h"

namespace strata::transport {

class FaultInjectingTransport final : public Transport {
 public:
  explicit FaultInjectingTransport(Transport* inner) : inner_(inner) {}

  // Message number n (1-based, counting data and piece messages) is corrupted / dropped when
  // pred(n) is true.
  std::function<bool(int)> corrupt = [](int) { return false; };
  std::function<bool(int)> drop = [](int) { return false; };
  // A block data message is also corrupted when this holds for its block id (every attempt).
  std::function<bool(absl::string_view)> corrupt_block = [](absl::string_view) { return false; };

  const Capabilities& capabilities() const override { return inner_->capabilities(); }
  std::string address() const override { return inner_->address(); }
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* d, size_t n,
                                                         MemoryKind k) override {
    return inner_->Register(d, n, k);
  }
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t n, MemoryKind k) override {
    auto r = inner_->Allocate(n, k);
    if (r.ok()) {  // the receiver's lent ring (tests here have one sender)
      std::lock_guard<std::mutex> lock(mu_);
      ring_ = std::span<uint8_t>((*r)->data(), (*r)->size());
    }
    return r;
  }
  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view a,
                                                    absl::Duration t) override {
    return inner_->Connect(a, t);
  }
  size_t max_header_size() const override { return inner_->max_header_size(); }

  void SetHandler(uint16_t id, MessageHandler h) override {
    if (!h || (id != kBlockDataMessage && id != kBlockPieceMessage)) {
      inner_->SetHandler(id, std::move(h));
      return;
    }
    inner_->SetHandler(id, [this, id, h = std::move(h)](IncomingMessage& m) {
      const int n = ++count_;
      if (drop(n)) return;
      bool bad = corrupt(n);
      if (!bad && id == kBlockDataMessage) {
        absl::StatusOr<BlockDataHeader> header = DecodeBlockDataHeader(m.header());
        bad = header.ok() && corrupt_block(header->block_id);
      }
      if (bad) CorruptPlaced(m.header());
      Faulty f(m, bad);
      h(f);
    });
  }

 private:
  // A block the sender wrote into the lent ring has landed before its header arrives: flip a bit
  // of it there.
  void CorruptPlaced(std::span<const uint8_t> header) {
    absl::StatusOr<BlockDataHeader> h = DecodeBlockDataHeader(header);
    if (!h.ok() || !h->placed || h->size == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (h->placed->offset < kPlacedPrefixBytes || h->placed->offset + h->size > ring_.size()) {
      return;
    }
    if (h->streamed) {  // the sender is still writing: corrupt what it has finished writing
      std::atomic_ref<uint64_t> progress(
          *reinterpret_cast<uint64_t*>(ring_.data() + h->placed->offset - kPlacedPrefixBytes));
      const absl::Time until = absl::Now() + absl::Seconds(5);
      while (progress.load() < h->size && absl::Now() < until) {
      }
    }
    ring_[h->placed->offset + h->size / 2] ^= 0x40;
  }

  class Faulty final : public IncomingMessage {
   public:
    Faulty(IncomingMessage& m, bool corrupt) : m_(m), corrupt_(corrupt) {}
    std::span<const uint8_t> header() const override { return m_.header(); }
    size_t payload_size() const override { return m_.payload_size(); }
    std::shared_ptr<Endpoint> endpoint() const override { return m_.endpoint(); }
    void Accept(Destination dest, Completion done) override {
      const bool corrupt = corrupt_;
      m_.Accept(dest, [dest, corrupt, done = std::move(done)](absl::Status s) {
        if (s.ok() && corrupt && !dest.bytes.empty()) dest.bytes[dest.bytes.size() / 2] ^= 0x40;
        done(std::move(s));
      });
    }

   private:
    IncomingMessage& m_;
    bool corrupt_;
  };

  Transport* inner_;
  std::atomic<int> count_{0};
  std::mutex mu_;
  std::span<uint8_t> ring_;
};

}  // namespace strata::transport
