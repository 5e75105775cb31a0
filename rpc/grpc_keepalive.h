// gRPC keepalive for Strata's node-to-node channels: a peer that stops answering (its host lost,
// its link down, the process stopped) fails the calls on the channel within about
// kKeepaliveTime + kKeepaliveTimeout (UNAVAILABLE), instead of each call waiting for its
// deadline. Clients ping every kKeepaliveTime, also without calls; servers accept pings that
// often (gRPC's default would answer them with GOAWAY "too_many_pings").
#pragma once

#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace strata::rpc {

inline constexpr int kKeepaliveTimeMs = 2000;
inline constexpr int kKeepaliveTimeoutMs = 2000;

inline void SetClientKeepalive(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

inline void AcceptClientKeepalive(grpc::ServerBuilder* b) {
  b->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                        kKeepaliveTimeMs / 2);
  b->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  b->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

}  // namespace strata::rpc
