// A decode node's process (decode_node_main.h): its flags, and RunDecodeNode, which strata-decode
// (decode_main.cc) runs and which a test binary runs with a transport hook.
#include "decode_node/decode_node_main.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/byte_size.h"
#include "common/host_port.h"
#include "decode_node/decode_engine.h"
#include "decode_node/decode_service.h"
#include "kvstore/store_client.h"
#include "membership/cluster_file.h"
#include "serving/node_flags.h"
#include "serving/node_process.h"
#include "transport/ucx/ucx_transport.h"

ABSL_FLAG(std::string, transport, "",
          "block transport (UCX) address (default: the node's transport in the file)");
ABSL_FLAG(int, max_batch, 32,
          "sequences stepped together (up to 64, each gets the logits it would get alone)");
ABSL_FLAG(std::string, kv_budget, "1G", "KV bytes (compressed) of running sequences");
ABSL_FLAG(int, max_waiting, 0,
          "registered requests not yet running (waiting for their KV or a place in the batch); "
          "more: refused (429 at the router). 0: 4 x --max_batch");
ABSL_FLAG(int, kv_timeout_ms, 60000,
          "registration to the end of the KV transfer, for a request without a deadline (the "
          "router gives every request one: the KV is awaited until then)");
ABSL_FLAG(bool, put_to_store, true, "Put generated chunks (and preempted sequences) in the store");
ABSL_FLAG(std::string, local_ram_bytes, "0",
          "the node's own RAM tier of blocks, in front of the shared store (0: none): a preempted "
          "sequence resumes from it, also while the store is away");
ABSL_FLAG(int, drain_timeout_s, 30,
          "on SIGTERM / SIGINT, leave the cluster (deregister, take nothing new) and let running "
          "sequences finish for up to this long; then hand the rest off (their KV to the store, "
          "the router continues them on another node). A second signal hands off at once");
ABSL_FLAG(int, listen_wait_s, 90,
          "when the transport's port is still held by a previous run's connections (TIME_WAIT), "
          "retry this long before giving up");

namespace {

int Fail(const std::string& what, const absl::Status& s, int code = 1) {
  std::cerr << "strata-decode: " << what << ": " << s << "\n";
  return code;
}

}  // namespace

namespace strata::decode {

int RunDecodeNode(int argc, char** argv, const TransportHook& hook) {
  strata::serving::BlockTerminationSignals();
  strata::serving::ConfigureFlagsUsage();
  absl::SetProgramUsageMessage(
      "a Strata decode node.\n  strata-decode --cluster cluster.json --node decode-0");
  absl::ParseCommandLine(argc, argv);
  namespace serving = strata::serving;
  namespace membership = strata::membership;
  uint64_t kv_budget = 0;
  if (!strata::ParseByteSize(absl::GetFlag(FLAGS_kv_budget), &kv_budget) || kv_budget == 0) {
    std::cerr << "strata-decode: --kv_budget: '" << absl::GetFlag(FLAGS_kv_budget)
              << "' is not a byte count (e.g. 512M, 8G)\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_batch) < 1 || absl::GetFlag(FLAGS_max_waiting) < 0 ||
      absl::GetFlag(FLAGS_kv_timeout_ms) < 1) {
    std::cerr
        << "strata-decode: --max_batch and --kv_timeout_ms must be >= 1, --max_waiting >= 0\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_listen_wait_s) < 0) {
    std::cerr << "strata-decode: --listen_wait_s must be >= 0\n";
    return 2;
  }
  serving::NodeStart n;
  serving::NodeStartError failed;
  if (!serving::StartNodeFromFlags({.process = "strata-decode",
                                    .role = membership::Role::kDecode,
                                    .transport = absl::GetFlag(FLAGS_transport),
                                    .local_ram_bytes = absl::GetFlag(FLAGS_local_ram_bytes)},
                                   &n, &failed)
           .ok()) {
    return Fail(failed.what, failed.status, failed.exit_code);
  }
  const std::string transport_address =
      absl::GetFlag(FLAGS_transport).empty() ? n.self.transport : absl::GetFlag(FLAGS_transport);
  if (absl::Status s = membership::ValidateHostPort(transport_address, "--transport"); !s.ok()) {
    return Fail("flags", s, 2);
  }

  strata::transport::UcxTransportOptions to;
  const strata::HostPort tp = *strata::ParseHostPort(transport_address);  // validated above
  to.listen_host = tp.host;
  to.listen_port = tp.port;
  to.tls = absl::GetFlag(FLAGS_ucx_tls);
  absl::StatusOr<std::unique_ptr<strata::transport::Transport>> transport =
      strata::transport::CreateUcxTransportWaitingForPort(
          to, absl::Seconds(absl::GetFlag(FLAGS_listen_wait_s)), [](const absl::Status& s) {
            serving::Log("", absl::StrCat(s.message(), "; retrying for up to ",
                                          absl::GetFlag(FLAGS_listen_wait_s), " s"));
          });
  if (!transport.ok()) return Fail("UCX transport", transport.status());
  // A test binary's wrapper around the transport (fault injection); none in strata-decode.
  std::unique_ptr<strata::transport::Transport> wrapped;
  strata::transport::Transport* receiving = transport->get();
  if (hook) {
    absl::StatusOr<std::unique_ptr<strata::transport::Transport>> w = hook(transport->get());
    if (!w.ok()) return Fail("flags", w.status(), 2);
    wrapped = *std::move(w);
    if (wrapped != nullptr) receiving = wrapped.get();
  }

  strata::decode::DecodeEngineOptions eo;
  eo.format = serving::FormatOf(n.spec, n.served);
  eo.max_batch = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_batch));
  eo.kv_budget_bytes = kv_budget;
  eo.max_waiting = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_waiting));
  eo.kv_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_kv_timeout_ms));
  eo.put_to_store = absl::GetFlag(FLAGS_put_to_store);
  absl::StatusOr<std::unique_ptr<strata::decode::DecodeEngine>> engine =
      strata::decode::DecodeEngine::Create(eo, n.served.model.get(), n.served.tokenizer.get(),
                                           receiving, n.store.blocks());
  if (!engine.ok()) return Fail("engine", engine.status(), 2);

  // The router reserves KV by this estimate: the codec's exact block size per token.
  const double kv_bytes_per_token = serving::KvBytesPerToken(n.spec, n.served);

  auto registry = std::make_shared<prometheus::Registry>();
  strata::decode::DecodeService service(engine->get(),
                                        {.node_id = n.self.id,
                                         .model_name = n.served.name,
                                         .incarnation = serving::NewIncarnation(),
                                         .kv_bytes_per_token = kv_bytes_per_token},
                                        registry.get());
  service.Refresh();  // the load routers read from the first call on
  serving::NodeServing running;
  if (!serving::ServeNode(
           n, "strata-decode", {&service}, registry, (*transport)->address(),
           [&](int port) {
             return absl::StrCat(
                 "serving ", n.served.name, " (codec ", n.spec.codec, ", ",
                 absl::StrFormat("%.0f", kv_bytes_per_token), " KV bytes/token) on port ", port,
                 "; blocks arrive at ", (*transport)->address(), "; store ",
                 n.spec.store.empty() ? "none" : n.spec.store, "; metrics ",
                 n.metrics.empty() ? "off" : n.metrics, "; ",
                 n.security->insecure() ? "INSECURE (--insecure)" : n.security->Describe());
           },
           &running, &failed)
           .ok()) {
    return Fail(failed.what, failed.status, failed.exit_code);
  }
  // The load the routers poll, kept fresh.
  std::atomic<bool> stop{false};
  std::thread refresher([&] {
    while (!stop.load()) {
      service.Refresh();
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  });
  const int sig = serving::WaitForTermination();
  // Drain: deregistered (routers following etcd drop it), reported `draining` to the routers that
  // poll it, new requests refused (routed elsewhere); running sequences finish, or are handed
  // off at the deadline.
  const absl::Duration drain = absl::Seconds(std::max(0, absl::GetFlag(FLAGS_drain_timeout_s)));
  serving::Log("",
               absl::StrCat("signal ", sig, ": draining for up to ", absl::FormatDuration(drain),
                            " (a second signal hands off at once)"));
  running.registration.reset();
  std::atomic<bool> drained{false};
  uint64_t handed_off = 0;
  std::thread drainer([&] {
    handed_off = (*engine)->Drain(absl::Now() + drain);
    drained = true;
  });
  while (!drained.load()) {
    if (serving::WaitForTerminationFor(absl::Milliseconds(100)) != 0) {
      serving::Log("", "second signal: handing off now");
      (*engine)->Drain(absl::Now());
    }
  }
  drainer.join();
  serving::Log("", absl::StrCat("drained: ", (*engine)->stats().handed_off,
                                " sequences handed off to other nodes (", handed_off,
                                " at the deadline); stopping"));
  service.Refresh();
  service.Stop();  // open streams end with UNAVAILABLE: their clients learn at once
  running.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  stop = true;
  refresher.join();
  engine->reset();
  std::cout << "strata-decode: stopped" << std::endl;
  return 0;
}

}  // namespace strata::decode
