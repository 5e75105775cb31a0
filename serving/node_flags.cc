#include "serving/node_flags.h"

#include <algorithm>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/host_port.h"
#include "kvstore/shared_tier_flags.h"
#include "membership/etcd_flags.h"
#include "membership/etcd_membership.h"
#include "model/cuda_plugin.h"
#include "serving/node_process.h"

ABSL_FLAG(std::string, cluster, "", "the cluster file (required)");
ABSL_FLAG(std::string, node, "", "this node's id in the cluster file (required)");
ABSL_FLAG(std::string, listen, "", "gRPC address (default: the node's grpc in the file)");
ABSL_FLAG(std::string, metrics, "", "Prometheus /metrics address (default: the file's; off: none)");
ABSL_FLAG(std::string, etcd, "",
          "etcd's client address (host:port): register there under a lease, for routers that "
          "follow etcd (empty: the cluster file is the membership)");
ABSL_FLAG(std::string, ucx_tls, "", "UCX transports (UCX_TLS), e.g. tcp; empty: UCX's choice");

ABSL_FLAG(std::string, device, "cpu",
          "where the node runs the model: cpu, or cuda[:N] (the CUDA plugin, --cuda_plugin; "
          "every codec but rotated ones (:rot), which are refused at start; fp16 and 2/4-bit "
          "kivi/kcvt pages take the fast kernels, the others a general kernel many times slower)");
ABSL_FLAG(std::string, cuda_plugin, "",
          "with --device cuda: the CUDA plugin (libstrata_cuda.so) to open; empty: lib/ beside "
          "the binary's folder, else beside the binary");
ABSL_FLAG(std::string, gpu_kv_bytes, "0",
          "with --device cuda: device memory for KV pages (e.g. 20G); 0: 90% of what is free "
          "once the weights are in");
ABSL_FLAG(int, gpu_max_sequences, 64,
          "with --device cuda: sequences holding a cache at once (each a window on the device)");
ABSL_FLAG(bool, cuda_graphs, true, "with --device cuda: replay decode steps as CUDA graphs");

ABSL_FLAG(std::string, host_name, "",
          "with --store host: the machine whose store to use, as the stores registered it "
          "(strata-store --host_name; default: the host of this node's --listen address; in "
          "Kubernetes, the node's name)");
ABSL_FLAG(std::string, store, "",
          "the store this node reads and writes (host:port), where every host runs a store of "
          "its own: its host's (default: the node's \"store\" in the cluster file, else the "
          "cluster's); `host`: with --etcd, the store registered there (strata-store --etcd) on "
          "this node's own host, waited for up to 30 s at start; registered in etcd with the "
          "node, so that the router credits the node with that store's chunks");

namespace strata::serving {

absl::Status UseNodeStoreFromFlags(membership::ClusterSpec* spec, membership::NodeSpec* self) {
  if (const std::string flag = absl::GetFlag(FLAGS_store); flag == "host") {
    const std::string etcd = absl::GetFlag(FLAGS_etcd);
    if (etcd.empty()) {
      return absl::InvalidArgumentError("--store host needs --etcd (the stores register there)");
    }
    std::string host = absl::GetFlag(FLAGS_host_name);
    if (host.empty()) {
      const std::string listen =
          absl::GetFlag(FLAGS_listen).empty() ? self->grpc : absl::GetFlag(FLAGS_listen);
      absl::StatusOr<HostPort> hp = ParseHostPort(listen);
      if (!hp.ok()) return hp.status();
      host = hp->host;
    }
    absl::StatusOr<std::string> prefix = membership::EtcdPrefixFromFlags();
    if (!prefix.ok()) return prefix.status();
    std::unique_ptr<membership::EtcdClient> client = membership::NewHttpEtcdClient(etcd);
    absl::StatusOr<membership::StoreSpec> store =
        membership::HostStore(*client, *prefix, host, absl::Seconds(30));
    if (!store.ok()) {
      return absl::Status(store.status().code(),
                          absl::StrCat("--store host: ", store.status().message()));
    }
    Log("", absl::StrCat("--store host: using store ", store->id, " at ", store->grpc,
                         " (registered in etcd ", etcd, ")"));
    self->store = store->grpc;
  } else if (!flag.empty()) {
    if (absl::Status s = membership::ValidateHostPort(flag, "--store"); !s.ok()) return s;
    self->store = flag;
  }
  if (!self->store.empty()) spec->store = self->store;
  return absl::OkStatus();
}

absl::Status StartNodeFromFlags(const NodeStartOptions& o, NodeStart* n, NodeStartError* error) {
  auto fail = [&](const char* what, absl::Status s, int code) {
    error->what = what;
    error->status = s;
    error->exit_code = code;
    return s;
  };
  if (absl::GetFlag(FLAGS_cluster).empty() || absl::GetFlag(FLAGS_node).empty()) {
    return fail("flags",
                absl::InvalidArgumentError("--cluster and --node are required (see --help)"), 2);
  }
  absl::StatusOr<std::string> prefix = membership::EtcdPrefixFromFlags();
  if (!prefix.ok()) return fail("flags", prefix.status(), 2);
  n->etcd_prefix = *std::move(prefix);
  absl::StatusOr<absl::Duration> lease = membership::EtcdLeaseFromFlags();
  if (!lease.ok()) return fail("flags", lease.status(), 2);
  n->etcd_lease = *lease;
  absl::StatusOr<membership::ClusterSpec> spec =
      membership::LoadClusterFile(absl::GetFlag(FLAGS_cluster));
  if (!spec.ok()) return fail("cluster file", spec.status(), 2);
  n->spec = *std::move(spec);
  absl::StatusOr<membership::NodeSpec> self =
      SelfNode(n->spec, absl::GetFlag(FLAGS_node), o.role, !absl::GetFlag(FLAGS_etcd).empty(),
               absl::GetFlag(FLAGS_listen), o.transport);
  if (!self.ok()) return fail("flags", self.status(), 2);
  n->self = *std::move(self);
  if (absl::Status s = UseNodeStoreFromFlags(&n->spec, &n->self); !s.ok()) {
    return fail("flags", s, 2);
  }
  n->listen = absl::GetFlag(FLAGS_listen).empty() ? n->self.grpc : absl::GetFlag(FLAGS_listen);
  n->metrics =
      absl::GetFlag(FLAGS_metrics).empty() ? n->self.metrics : absl::GetFlag(FLAGS_metrics);
  if (n->metrics == "off") n->metrics.clear();
  if (!ParseByteSize(o.local_ram_bytes, &n->local_ram_bytes)) {
    return fail(
        "flags",
        absl::InvalidArgumentError(absl::StrCat("--local_ram_bytes: '", o.local_ram_bytes,
                                                "' is not a byte count (e.g. 0, 512M, 8G)")),
        2);
  }
  SetLogIdentity(o.process, n->self.id);
  absl::StatusOr<std::shared_ptr<const rpc::GrpcSecurity>> security = NodeSecurityFromFlags();
  if (!security.ok()) return fail("flags", security.status(), 2);
  n->security = *std::move(security);
  absl::StatusOr<model::Device> device = NodeDeviceFromFlags();
  if (!device.ok()) return fail("flags", device.status(), 2);
  absl::StatusOr<ServedModel> served = LoadServedModel(n->spec.model, n->spec.calibration, *device);
  if (!served.ok()) return fail("model", served.status(), 1);
  n->served = *std::move(served);
  absl::StatusOr<StoreConnection> store =
      ConnectStoreFromFlags(n->spec, n->security, n->local_ram_bytes);
  if (!store.ok()) return fail("store", store.status(), 1);
  n->store = *std::move(store);
  return absl::OkStatus();
}

absl::Status ServeNode(const NodeStart& n, const char* process,
                       const std::vector<grpc::Service*>& services,
                       const std::shared_ptr<prometheus::Registry>& registry,
                       const std::string& transport,
                       const std::function<std::string(int port)>& serving_line, NodeServing* out,
                       NodeStartError* error) {
  auto fail = [&](const char* what, absl::Status s) {
    error->what = what;
    error->status = s;
    error->exit_code = 1;
    return s;
  };
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(services, n.listen, *n.security, &out->port);
  if (!server.ok()) return fail("gRPC", server.status());
  out->server = *std::move(server);
  if (!n.metrics.empty()) {
    absl::StatusOr<std::unique_ptr<prometheus::Exposer>> e = StartMetrics(n.metrics, registry);
    if (!e.ok()) return fail("metrics", e.status());
    out->metrics = *std::move(e);
  }
  Log("", serving_line(out->port));
  membership::NodeSpec announce = n.self;
  announce.grpc = JoinHostPort(ParseHostPort(n.listen)->host, out->port);
  announce.metrics = n.metrics;
  if (!transport.empty()) announce.transport = transport;
  absl::StatusOr<std::unique_ptr<membership::EtcdRegistration>> registration =
      RegisterWithEtcd(absl::GetFlag(FLAGS_etcd), n.etcd_prefix, announce, n.etcd_lease);
  if (!registration.ok()) return fail("etcd", registration.status());
  out->registration = *std::move(registration);
  std::cout << process << ": serving on port " << out->port << std::endl;
  return absl::OkStatus();
}

absl::StatusOr<StoreConnection> ConnectStoreFromFlags(
    const membership::ClusterSpec& spec, std::shared_ptr<const rpc::GrpcSecurity> security,
    uint64_t local_ram_bytes) {
  absl::StatusOr<std::optional<kvstore::SharedTierOptions>> shared =
      kvstore::SharedTierOptionsFromFlags();
  if (!shared.ok()) return shared.status();
  return ConnectStore(spec, std::move(security), local_ram_bytes, *shared);
}

absl::StatusOr<model::Device> NodeDeviceFromFlags() {
  absl::StatusOr<model::Device> device = model::ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok() || device->kind != model::Device::Kind::kCuda) return device;
  model::CudaPluginOptions options;
  if (!ParseByteSize(absl::GetFlag(FLAGS_gpu_kv_bytes), &options.kv_pool_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("--gpu_kv_bytes: '",
                                                   absl::GetFlag(FLAGS_gpu_kv_bytes),
                                                   "' is not a byte count (e.g. 0, 512M, 20G)"));
  }
  const int sequences = absl::GetFlag(FLAGS_gpu_max_sequences);
  if (sequences < 1 || sequences > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu_max_sequences: ", sequences, " (1 to 65536)"));
  }
  options.max_sequences = static_cast<uint32_t>(sequences);
  options.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  const std::string path = absl::GetFlag(FLAGS_cuda_plugin).empty()
                               ? model::DefaultCudaPluginPath()
                               : absl::GetFlag(FLAGS_cuda_plugin);
  absl::StatusOr<model::BackendLoader> loader = model::OpenCudaPlugin(path, options);
  if (!loader.ok()) {
    return absl::Status(loader.status().code(),
                        absl::StrCat("device ", device->ToString(), ": ", loader.status().message(),
                                     "; or use --device cpu"));
  }
  model::SetCudaBackendLoader(*std::move(loader));
  return device;
}

absl::StatusOr<std::shared_ptr<const rpc::GrpcSecurity>> NodeSecurityFromFlags() {
  return LoadGrpcSecurity(rpc::GrpcSecurityOptionsFromFlags());
}

}  // namespace strata::serving
