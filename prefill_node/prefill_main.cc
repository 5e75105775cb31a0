// strata-prefill: a prefill node. Reads its settings from the cluster file (its entry by id, and
// what the cluster serves: model, codec, chunk size, store); flags override.
//   strata-prefill --cluster cluster.json --node prefill-0
#include <algorithm>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_size.h"
#include "common/host_port.h"
#include "kvstore/block_source.h"
#include "kvstore/block_store.h"
#include "kvstore/store_client.h"
#include "kvstore/store_service.h"
#include "membership/cluster_file.h"
#include "prefill_node/prefill_engine.h"
#include "prefill_node/prefill_service.h"
#include "serving/node_flags.h"
#include "serving/node_process.h"
#include "transport/ucx/ucx_transport.h"

ABSL_FLAG(int, max_concurrent, 1, "prompts computed at once");
ABSL_FLAG(int64_t, max_queued_tokens, 1 << 20, "prompt tokens waiting or computing; more: 429");
ABSL_FLAG(int, max_queue_ms, 10000,
          "prompt tokens queued at most: what the node computes in this long at its measured rate "
          "(0: only --max_queued_tokens bounds the queue); more are refused (429 at the router)");
ABSL_FLAG(int, measure_tokens, -1,
          "at start, time a prompt of this many tokens to seed the rate admission uses (-1: one "
          "chunk; 0: none, the first requests measure it)");
ABSL_FLAG(int, ship_timeout_ms, 30000, "per block, send to acknowledgement");
ABSL_FLAG(bool, put_to_store, true, "Put newly computed chunks in the store");
ABSL_FLAG(std::string, local_ram_bytes, "0",
          "the node's own RAM tier of blocks, in front of the shared store (0: none); the router "
          "sends a prompt to the node that holds its prefix");
ABSL_FLAG(int, drain_timeout_s, 30,
          "on SIGTERM / SIGINT, leave the cluster (deregister, take nothing new) and let the "
          "requests under way finish for up to this long. A second signal stops at once");

namespace {

int Fail(const std::string& what, const absl::Status& s, int code = 1) {
  std::cerr << "strata-prefill: " << what << ": " << s << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  strata::serving::BlockTerminationSignals();
  strata::serving::ConfigureFlagsUsage();
  absl::SetProgramUsageMessage(
      "a Strata prefill node.\n  strata-prefill --cluster cluster.json --node prefill-0");
  absl::ParseCommandLine(argc, argv);
  namespace serving = strata::serving;
  namespace membership = strata::membership;
  if (absl::GetFlag(FLAGS_max_concurrent) < 1 || absl::GetFlag(FLAGS_max_queued_tokens) < 1 ||
      absl::GetFlag(FLAGS_ship_timeout_ms) < 1) {
    std::cerr << "strata-prefill: --max_concurrent, --max_queued_tokens and --ship_timeout_ms "
                 "must be >= 1\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_queue_ms) < 0 || absl::GetFlag(FLAGS_measure_tokens) < -1) {
    std::cerr << "strata-prefill: --max_queue_ms must be >= 0 and --measure_tokens >= -1\n";
    return 2;
  }
  serving::NodeStart n;
  serving::NodeStartError failed;
  if (!serving::StartNodeFromFlags({.process = "strata-prefill",
                                    .role = membership::Role::kPrefill,
                                    .local_ram_bytes = absl::GetFlag(FLAGS_local_ram_bytes)},
                                   &n, &failed)
           .ok()) {
    return Fail(failed.what, failed.status, failed.exit_code);
  }
  // The node's own RAM tier (when asked for), served (Store service) on the node's gRPC port so
  // that the router's prefix index knows what this node holds.
  std::unique_ptr<strata::kvstore::StoreService> local_service;
  if (n.store.local != nullptr) {
    local_service =
        std::make_unique<strata::kvstore::StoreService>(n.store.local.get(), size_t{64} << 20);
  }
  strata::kvstore::BlockSource* blocks = n.store.blocks();

  strata::transport::UcxTransportOptions to;
  to.listen_host = "";  // a prefill node only connects to decode nodes
  to.tls = absl::GetFlag(FLAGS_ucx_tls);
  absl::StatusOr<std::unique_ptr<strata::transport::Transport>> transport =
      strata::transport::CreateUcxTransport(to);
  if (!transport.ok()) return Fail("UCX transport", transport.status());

  strata::prefill::PrefillEngineOptions eo;
  eo.format = serving::FormatOf(n.spec, n.served);
  eo.max_concurrent = absl::GetFlag(FLAGS_max_concurrent);
  eo.max_queued_tokens = static_cast<uint64_t>(absl::GetFlag(FLAGS_max_queued_tokens));
  eo.max_queue_time = absl::Milliseconds(absl::GetFlag(FLAGS_max_queue_ms));
  eo.ship_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_ship_timeout_ms));
  eo.put_to_store = absl::GetFlag(FLAGS_put_to_store);
  absl::StatusOr<std::unique_ptr<strata::prefill::PrefillEngine>> engine =
      strata::prefill::PrefillEngine::Create(eo, n.served.model.get(), transport->get(), blocks);
  if (!engine.ok()) return Fail("engine", engine.status(), 2);
  const int measure = absl::GetFlag(FLAGS_measure_tokens);
  if (measure != 0) {
    const uint32_t tokens = measure < 0 ? n.spec.chunk_tokens : static_cast<uint32_t>(measure);
    if (absl::Status s = (*engine)->MeasureThroughput(tokens); !s.ok()) {
      return Fail("measuring the prefill rate", s);
    }
    const strata::prefill::PrefillLoad load = (*engine)->load();
    serving::Log("",
                 absl::StrFormat("prefill rate %.0f prompt tokens/s (%u tokens timed): the queue "
                                 "takes up to %u tokens",
                                 load.tokens_per_second, tokens, load.max_queued_tokens));
  }

  auto registry = std::make_shared<prometheus::Registry>();
  strata::prefill::PrefillService service(engine->get(),
                                          {.node_id = n.self.id,
                                           .model_name = n.served.name,
                                           .incarnation = serving::NewIncarnation(),
                                           .local_tier_bytes = n.local_ram_bytes},
                                          registry.get());
  serving::NodeServing running;
  if (!serving::ServeNode(
           n, "strata-prefill", {&service, local_service.get()}, registry, "",
           [&](int port) {
             return absl::StrCat(
                 "serving ", n.served.name, " (codec ", n.spec.codec, ", chunk ",
                 n.spec.chunk_tokens, ") on port ", port, "; store ",
                 n.spec.store.empty() ? "none" : n.spec.store, "; local tier ",
                 n.local_ram_bytes > 0 ? absl::StrCat(n.local_ram_bytes >> 20, " MiB") : "none",
                 "; metrics ", n.metrics.empty() ? "off" : n.metrics, "; ",
                 n.security->insecure() ? "INSECURE (--insecure)" : n.security->Describe());
           },
           &running, &failed)
           .ok()) {
    return Fail(failed.what, failed.status, failed.exit_code);
  }
  const int sig = serving::WaitForTermination();
  const absl::Duration drain = absl::Seconds(std::max(0, absl::GetFlag(FLAGS_drain_timeout_s)));
  serving::Log("", absl::StrCat("signal ", sig, ": draining for up to ",
                                absl::FormatDuration(drain), " (a second signal stops at once)"));
  running.registration.reset();
  service.StartDraining();
  for (const absl::Time deadline = absl::Now() + drain;
       service.active() > 0 && absl::Now() < deadline;) {
    if (serving::WaitForTerminationFor(absl::Milliseconds(50)) != 0) break;
  }
  serving::Log("", absl::StrCat("drained (", service.active(), " requests left); stopping"));
  // Requests under way get a few seconds to finish; the rest are cancelled (their decode nodes
  // are told to drop them by the engine's abort shipment).
  running.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  engine->reset();
  std::cout << "strata-prefill: stopped" << std::endl;
  return 0;
}
