#include "kvstore/store_client.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/aligned_buffer.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "rpc/grpc_keepalive.h"
#include "rpc/grpc_status.h"

namespace strata::kvstore {
namespace {

std::string KeyBytes(const BlockHash& k) {
  return std::string(reinterpret_cast<const char*>(k.data()), k.size());
}

Tier FromProto(strata::v1::Tier t) {
  switch (t) {
    case strata::v1::TIER_RAM:
      return Tier::kRam;
    case strata::v1::TIER_DISK:
      return Tier::kDisk;
    default:
      return Tier::kNone;
  }
}

int Millis(absl::Duration d) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d), INT32_MAX));
}

}  // namespace

absl::Status StoreClientOptions::Validate() const {
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("store client: timeout must be positive");
  }
  if (max_block_bytes == 0) {
    return absl::InvalidArgumentError("store client: max_block_bytes must be positive");
  }
  if (min_reconnect_backoff <= absl::ZeroDuration() ||
      max_reconnect_backoff < min_reconnect_backoff) {
    return absl::InvalidArgumentError(
        "store client: reconnect backoff needs 0 < min_reconnect_backoff <= max_reconnect_backoff");
  }
  if (watch_retry <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("store client: watch_retry must be positive");
  }
  return absl::OkStatus();
}

StoreClient::StoreClient(std::string address, StoreClientOptions options,
                         std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(strata::v1::Store::NewStub(channel_)) {}

StoreClient::~StoreClient() = default;

absl::StatusOr<std::unique_ptr<StoreClient>> StoreClient::Connect(const std::string& address,
                                                                  absl::Duration timeout,
                                                                  StoreClientOptions options) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  grpc::ChannelArguments args;
  rpc::SetClientKeepalive(&args);
  const int limit =
      static_cast<int>(std::min<size_t>(options.max_block_bytes + (size_t{1} << 20), INT32_MAX));
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  // gRPC backs off up to two minutes between reconnection attempts by default: far too long to
  // notice a restarted store.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, Millis(options.min_reconnect_backoff));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, Millis(options.min_reconnect_backoff));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, Millis(options.max_reconnect_backoff));
  std::shared_ptr<grpc::Channel> channel =
      options.security != nullptr
          ? options.security->CreateChannel(address, args)
          : grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (timeout > absl::ZeroDuration() &&
      !channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "store ", address, ": UNAVAILABLE: not reachable within ", absl::FormatDuration(timeout)));
  }
  return std::unique_ptr<StoreClient>(
      new StoreClient(address, std::move(options), std::move(channel)));
}

absl::Status StoreClient::Error(const grpc::Status& s) const {
  return rpc::FromGrpc(s, absl::StrCat("store ", address_));
}

void StoreClient::SetDeadline(grpc::ClientContext* ctx) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
}

absl::StatusOr<LookupResult> StoreClient::Lookup(
    const BlockName& prefix, absl::Span<const BlockHash> chain,
    absl::Span<const uint64_t> layer_codec_fingerprints) {
  strata::v1::LookupRequest req;
  req.set_model_fingerprint(prefix.model_fingerprint);
  req.set_codec_fingerprint(prefix.codec_fingerprint);
  req.set_calibration_fingerprint(prefix.calibration_fingerprint);
  for (const BlockHash& k : chain) req.add_chain(KeyBytes(k));
  req.set_layers(static_cast<uint32_t>(layer_codec_fingerprints.size()));
  for (uint64_t f : layer_codec_fingerprints) req.add_layer_codec_fingerprints(f);
  strata::v1::LookupResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  const grpc::Status s = stub_->Lookup(&ctx, req, &resp);
  if (!s.ok()) return Error(s);
  LookupResult r;
  r.chunks = resp.chunks();
  for (int t : resp.tiers()) r.tiers.push_back(FromProto(static_cast<strata::v1::Tier>(t)));
  if (r.tiers.size() != r.chunks) {
    return absl::DataLossError(absl::StrCat("store ", address_, ": lookup answered ", r.chunks,
                                            " chunks with ", r.tiers.size(), " tiers"));
  }
  return r;
}

absl::Status StoreClient::Put(const BlockName& name, const BlockHash* parent,
                              absl::Span<const uint8_t> block) {
  if (block.size() > options_.max_block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store ", address_, ": block of ", block.size(),
                                                   " bytes exceeds max_block_bytes ",
                                                   options_.max_block_bytes));
  }
  strata::v1::PutRequest req;
  req.set_name(name.Encode());
  if (parent != nullptr) req.set_parent_key(KeyBytes(*parent));
  req.set_block(reinterpret_cast<const char*>(block.data()), block.size());
  strata::v1::PutResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  const grpc::Status s = stub_->Put(&ctx, req, &resp);
  return s.ok() ? absl::OkStatus() : Error(s);
}

absl::StatusOr<std::vector<absl::Status>> StoreClient::PutMany(absl::Span<const PutItem> items) {
  std::vector<absl::Status> out(items.size());
  std::vector<size_t> sent;  // indexes of the items that went out, in order
  strata::v1::PutStreamResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  std::unique_ptr<grpc::ClientWriter<strata::v1::PutRequest>> writer =
      stub_->PutStream(&ctx, &resp);
  strata::v1::PutRequest req;
  for (size_t i = 0; i < items.size(); ++i) {
    const PutItem& item = items[i];
    if (item.block.size() > options_.max_block_bytes) {
      out[i] = absl::InvalidArgumentError(
          absl::StrCat("store ", address_, ": block of ", item.block.size(),
                       " bytes exceeds max_block_bytes ", options_.max_block_bytes));
      continue;
    }
    req.Clear();
    req.set_name(item.name.Encode());
    if (item.parent) req.set_parent_key(KeyBytes(*item.parent));
    req.set_block(reinterpret_cast<const char*>(item.block.data()), item.block.size());
    if (!writer->Write(req)) break;  // the stream broke: Finish says why
    sent.push_back(i);
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return Error(s);
  if (static_cast<size_t>(resp.results_size()) != sent.size()) {
    return absl::DataLossError(absl::StrCat("store ", address_, ": put stream answered ",
                                            resp.results_size(), " of ", sent.size(), " blocks"));
  }
  for (size_t j = 0; j < sent.size(); ++j) {
    const strata::v1::PutResult& r = resp.results(static_cast<int>(j));
    if (r.code() == 0) continue;
    out[sent[j]] = Error(grpc::Status(static_cast<grpc::StatusCode>(r.code()), r.message()));
  }
  return out;
}

absl::StatusOr<SharedBytes> StoreClient::Get(const BlockName& name) {
  strata::v1::GetRequest req;
  req.set_name(name.Encode());
  req.set_max_chunk_bytes(options_.get_piece_bytes);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  std::unique_ptr<grpc::ClientReader<strata::v1::GetResponse>> reader = stub_->Get(&ctx, req);
  strata::v1::GetResponse piece;
  std::optional<AlignedBuffer> buffer;
  size_t got = 0;
  absl::Status refused;  // our own verdict on what the server sent
  while (reader->Read(&piece)) {
    if (!buffer) {
      if (piece.total_bytes() > options_.max_block_bytes) {
        refused = absl::ResourceExhaustedError(
            absl::StrCat("store ", address_, ": get announced ", piece.total_bytes(),
                         " bytes, more than max_block_bytes ", options_.max_block_bytes));
        break;
      }
      buffer = AlignedBuffer::Uninitialized(piece.total_bytes());
    }
    if (piece.data().size() > buffer->size() - got) {
      refused = absl::DataLossError(absl::StrCat("store ", address_, ": get sent more than the ",
                                                 buffer->size(), " bytes it announced"));
      break;
    }
    std::memcpy(buffer->data() + got, piece.data().data(), piece.data().size());
    got += piece.data().size();
  }
  if (!refused.ok()) ctx.TryCancel();  // (Finish then reports CANCELLED: ours is the reason)
  const grpc::Status s = reader->Finish();
  if (!refused.ok()) return refused;
  if (!s.ok()) return Error(s);
  if (!buffer || got != buffer->size()) {
    return absl::DataLossError(absl::StrCat("store ", address_, ": get sent ", got, " of ",
                                            buffer ? buffer->size() : 0, " announced bytes"));
  }
  return SharedBytes::FromBuffer(std::move(*buffer));
}

absl::StatusOr<bool> StoreClient::Delete(const BlockName& name) {
  strata::v1::DeleteRequest req;
  req.set_name(name.Encode());
  strata::v1::DeleteResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  const grpc::Status s = stub_->Delete(&ctx, req, &resp);
  if (!s.ok()) return Error(s);
  return resp.deleted();
}

absl::StatusOr<StoreStats> StoreClient::Stats() {
  strata::v1::StatsResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  const grpc::Status s = stub_->Stats(&ctx, strata::v1::StatsRequest(), &resp);
  if (!s.ok()) return Error(s);
  StoreStats st;
  const std::pair<const char*, uint64_t StoreStats::*> fields[] = {
      {"puts", &StoreStats::puts},
      {"duplicate_puts", &StoreStats::duplicate_puts},
      {"refused_puts", &StoreStats::refused_puts},
      {"ram_hits", &StoreStats::ram_hits},
      {"disk_hits", &StoreStats::disk_hits},
      {"misses", &StoreStats::misses},
      {"ram_evictions", &StoreStats::ram_evictions},
      {"disk_evictions", &StoreStats::disk_evictions},
      {"spills", &StoreStats::spills},
      {"promotions", &StoreStats::promotions},
      {"orphans_dropped", &StoreStats::orphans_dropped},
      {"corruptions", &StoreStats::corruptions},
      {"deletes", &StoreStats::deletes},
      {"put_conflicts", &StoreStats::put_conflicts},
      {"index_lost_blocks", &StoreStats::index_lost_blocks},
      {"index_recovered_blocks", &StoreStats::index_recovered_blocks},
      {"index_errors", &StoreStats::index_errors},
      {"ram_blocks", &StoreStats::ram_blocks},
      {"ram_bytes", &StoreStats::ram_bytes},
      {"disk_blocks", &StoreStats::disk_blocks},
      {"disk_bytes", &StoreStats::disk_bytes},
      {"spill_queue_bytes", &StoreStats::spill_queue_bytes},
      {"pool_idle_bytes", &StoreStats::pool_idle_bytes},
      {"pool_reuses", &StoreStats::pool_reuses},
  };
  for (const auto& [field, member] : fields) {
    auto it = resp.counters().find(field);
    if (it != resp.counters().end()) st.*member = it->second;  // (an older server lacks some)
  }
  return st;
}

std::unique_ptr<StoreWatch> StoreClient::Watch(uint64_t after_event_id, WatchCallback callback) {
  return std::unique_ptr<StoreWatch>(new StoreWatch(this, after_event_id, std::move(callback)));
}

StoreWatch::StoreWatch(StoreClient* client, uint64_t after_event_id, WatchCallback callback)
    : client_(client), callback_(std::move(callback)), after_(after_event_id) {
  thread_ = std::thread([this] { Run(); });
}

StoreWatch::~StoreWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    if (active_ != nullptr) active_->TryCancel();  // (before the call starts, it never starts)
  }
  cv_.notify_all();
  thread_.join();
}

bool StoreWatch::SleepUnlessStopped(absl::Duration d) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, absl::ToChronoNanoseconds(d), [&] { return stopped_; });
  return !stopped_;
}

void StoreWatch::Run() {
  const absl::Duration first_retry = client_->options_.watch_retry;
  absl::Duration retry = first_retry;
  while (true) {
    grpc::ClientContext ctx;  // no deadline: a watch lives until it is destroyed
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      active_ = &ctx;
    }
    strata::v1::WatchRequest req;
    req.set_after_event_id(after_);
    req.set_store_id(store_id_);
    std::unique_ptr<grpc::ClientReader<strata::v1::BlockEvent>> reader =
        client_->stub_->Watch(&ctx, req);
    strata::v1::BlockEvent msg;
    absl::Status bad;
    while (reader->Read(&msg)) {
      retry = first_retry;  // it works again
      WatchUpdate u;
      u.store_id = msg.store_id();
      u.event_id = msg.event_id();
      if (msg.snapshot_end()) {
        u.kind = WatchUpdate::Kind::kSnapshotEnd;
      } else {
        absl::StatusOr<BlockName> name = BlockName::Decode(msg.name());
        if (!name.ok() ||
            (msg.kind() != strata::v1::BLOCK_STORED && msg.kind() != strata::v1::BLOCK_REMOVED)) {
          bad = absl::DataLossError(
              absl::StrCat("store ", client_->address(), ": watch sent a malformed event"));
          ctx.TryCancel();
          break;
        }
        u.kind = msg.snapshot() ? WatchUpdate::Kind::kSnapshotBlock : WatchUpdate::Kind::kEvent;
        u.event.id = msg.snapshot() ? 0 : msg.event_id();
        u.event.kind = msg.kind() == strata::v1::BLOCK_STORED ? BlockEventKind::kStored
                                                              : BlockEventKind::kRemoved;
        u.event.name = *name;
        u.event.tier = FromProto(msg.tier());
      }
      // Resume after what was delivered whole: a live event, or a complete snapshot.
      if (u.kind != WatchUpdate::Kind::kSnapshotBlock) {
        after_ = u.event_id;
        store_id_ = u.store_id;
      }
      callback_(u);
    }
    const grpc::Status s = reader->Finish();
    {
      std::lock_guard<std::mutex> lock(mu_);
      active_ = nullptr;
      if (stopped_) return;
    }
    WatchUpdate down;
    down.kind = WatchUpdate::Kind::kDisconnected;
    down.store_id = store_id_;
    down.event_id = after_;
    down.status = !bad.ok() ? bad
                  : s.ok()  ? absl::UnavailableError(absl::StrCat("store ", client_->address(),
                                                                  ": the watch stream ended"))
                            : client_->Error(s);
    callback_(down);
    if (!SleepUnlessStopped(retry)) return;
    retry = std::min(retry * 2, first_retry * 8);
  }
}

}  // namespace strata::kvstore
