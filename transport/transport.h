// The transport interface: moves bytes between nodes. One lifecycle for every backend
// (in-process, UCX, NCCL), after NIXL's:
//
//   register memory  ->  MemoryRegion        (Transport::Register)
//   connect to peer  ->  Endpoint            (Transport::Connect(peer's Transport::address()))
//   post a transfer  ->  completion callback (Endpoint::Send, or Endpoint::Put where one-sided)
//   cancel / timeout ->  the same callback, CANCELLED / DEADLINE_EXCEEDED / UNAVAILABLE
//
// Messages are active messages: a small header plus an optional payload. The receiving
// transport calls the handler registered for the message's id with an IncomingMessage; the
// handler decides where the payload goes (Accept into memory it owns, ideally registered) or
// drops it. The block shipping protocol (block_protocol.h) is built on this; most code should
// use that rather than this layer.
//
// Completion contract: every posted transfer completes exactly once, with a status, after the
// backend no longer reads the source (Send, Put) or writes the destination (Accept). Callbacks
// run on a backend thread, or on the caller's before Send/Put/Accept returns (an immediate
// failure, an in-process copy): they must not block, must not take locks the caller may hold
// across the call, and must not destroy the transport.
//
// Thread safety: Transport, Endpoint and MemoryRegion methods may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace strata::transport {

enum class MemoryKind : uint8_t { kHost, kDevice };

// What a backend can do; callers adapt (e.g. fall back from Put to Send).
struct Capabilities {
  std::string backend;          // "inproc", "ucx", "nccl"
  bool one_sided = false;       // Endpoint::Put into a peer's registered region
  bool device_memory = false;   // Register(MemoryKind::kDevice)
  bool cross_process = false;   // peers may be other processes or hosts
  bool maps_peer_memory = false;  // Endpoint::Map can succeed (for some peers: same host)
};

// A registered region of memory. Owned by the caller of Register; deregisters when destroyed
// (after every transfer using it has completed: the caller's responsibility).
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  MemoryKind kind() const { return kind_; }
  // Opaque bytes a peer passes to Endpoint::Put to write into this region. UNIMPLEMENTED where
  // the backend is not one-sided.
  virtual absl::StatusOr<std::string> RemoteDescriptor() const = 0;

 protected:
  MemoryRegion(uint8_t* data, size_t size, MemoryKind kind)
      : data_(data), size_(size), kind_(kind) {}

 private:
  uint8_t* data_;
  size_t size_;
  MemoryKind kind_;
};

// Bytes to send: a view, optionally inside a registered region (zero-copy where the backend
// can; otherwise the backend registers or copies as it needs).
struct Payload {
  std::span<const uint8_t> bytes{};
  const MemoryRegion* region = nullptr;  // if set, bytes lies inside it
};

// Bytes to receive into: a view, optionally inside a registered region.
struct Destination {
  std::span<uint8_t> bytes{};
  const MemoryRegion* region = nullptr;
};

using Completion = std::function<void(absl::Status)>;

// Message ids are 0..kMaxMessageId; Send refuses others with INVALID_ARGUMENT.
inline constexpr uint16_t kMaxMessageId = 63;

// A connection to one peer. Shared: the transport keeps endpoints that peers connected to, and
// hands them to handlers so that replies go back the way the message came.
class Endpoint {
 public:
  virtual ~Endpoint() = default;

  // Sends header + payload as message `id`. The header is copied before Send returns; the payload
  // must stay valid until `done` runs. Errors: UNAVAILABLE (peer gone / connection failed),
  // INVALID_ARGUMENT (header too large, unknown id), CANCELLED, DEADLINE_EXCEEDED (timeout:
  // absl::InfiniteDuration() for none). Returns a transfer id for Cancel.
  virtual uint64_t Send(uint16_t id, std::span<const uint8_t> header, Payload payload,
                        absl::Duration timeout, Completion done) = 0;

  // One-sided write of `payload` into the peer's region described by `remote` (from the peer's
  // MemoryRegion::RemoteDescriptor()) at `remote_offset`. `done` runs when the data is in the
  // peer's memory. UNIMPLEMENTED where Capabilities::one_sided is false.
  virtual uint64_t Put(Payload payload, absl::string_view remote, uint64_t remote_offset,
                       absl::Duration timeout, Completion done) = 0;

  // Maps the peer's region described by `remote` (its MemoryRegion::RemoteDescriptor()) into this
  // process for plain loads and stores: one copy by this process's CPU instead of a transfer.
  // Where the backend can (UCX: a same-host peer's memory from Transport::Allocate, through
  // shared memory); UNIMPLEMENTED otherwise (another host, no shared-memory transport, inproc),
  // INVALID_ARGUMENT for a descriptor that is not one. The mapping stays valid while the caller
  // holds this endpoint and the transport runs, even after the peer frees the region or dies
  // (the memory is then detached from the peer). Stores are visible to the peer before any message sent after them.
  virtual absl::StatusOr<std::span<uint8_t>> Map(absl::string_view remote) {
    (void)remote;
    return absl::UnimplementedError("this transport cannot map a peer's memory");
  }

  // Ends a mapping Map returned (by its first byte); the caller must no longer touch it. Unknown
  // addresses are ignored. (Without it the mapping ends with the endpoint or the transport.)
  virtual void Unmap(const uint8_t* base) { (void)base; }

  // Stops a transfer: its completion runs with CANCELLED promptly (or with its own status if it
  // had already finished). A transfer the backend cannot recall once started (a UCX rendezvous
  // send) resets the connection: the endpoint's other transfers fail with UNAVAILABLE.
  virtual void Cancel(uint64_t transfer_id) = 0;

  // OK while usable; the failure otherwise (UNAVAILABLE with the backend's reason).
  virtual absl::Status health() const = 0;

  // Runs `fn` once when the endpoint fails (peer died, connection reset, transport shut down),
  // at once if it already has. Returns a handle for RemoveFailureCallback.
  virtual uint64_t OnFailure(std::function<void(const absl::Status&)> fn) = 0;
  virtual void RemoveFailureCallback(uint64_t handle) = 0;

  // The peer's address as given to Connect (or what the backend knows of an accepted peer).
  virtual std::string peer() const = 0;

  // What the connection runs over, for logs and benchmark reports (UCX: its lanes, e.g.
  // "am: posix/memory; rma: cma/memory").
  virtual std::string Describe() const { return peer(); }
};

// A message arriving for a registered handler. Valid only during the handler call.
class IncomingMessage {
 public:
  virtual ~IncomingMessage() = default;
  virtual std::span<const uint8_t> header() const = 0;
  virtual size_t payload_size() const = 0;
  // The connection the message came on; replies go here.
  virtual std::shared_ptr<Endpoint> endpoint() const = 0;
  // Places the payload in `dest` (dest.bytes.size() == payload_size()); `done` runs when it is
  // there (possibly before Accept returns) or with the failure (peer gone mid-transfer: partial
  // data must be discarded). Called at most once, during the handler; without it the payload
  // is dropped.
  virtual void Accept(Destination dest, Completion done) = 0;
};

using MessageHandler = std::function<void(IncomingMessage&)>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual const Capabilities& capabilities() const = 0;

  // Where peers Connect to reach this transport ("inproc://name", "ucx://host:port").
  virtual std::string address() const = 0;

  // Registers memory for zero-copy transfers. INVALID_ARGUMENT for an empty region,
  // UNIMPLEMENTED for device memory where the backend has none.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* data, size_t size,
                                                                 MemoryKind kind) = 0;

  // Allocates `size` bytes of registered memory that the backend moves fastest (UCX: memory it
  // maps itself, which a same-host peer's UCX reads in place, one copy instead of two). The
  // region owns the memory. Errors as Register.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t size,
                                                                 MemoryKind kind) = 0;

  // Connects to a peer; returns once the connection is usable or with UNAVAILABLE (nobody there,
  // refused, `timeout` passed) / INVALID_ARGUMENT (malformed address).
  virtual absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view address,
                                                            absl::Duration timeout) = 0;

  // Installs the handler for message `id` (replacing any; ids 0..63, kMaxMessageId). Handlers run
  // on a backend thread, one message at a time per transport; they must not block. A message
  // for an id without a handler is dropped.
  virtual void SetHandler(uint16_t id, MessageHandler handler) = 0;

  // Largest header Send accepts.
  virtual size_t max_header_size() const = 0;
};

}  // namespace strata::transport
