#include "cluster/node_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cluster/node_process.h"
#include "common/byte_size.h"
#ifdef STRATA_WITH_CUDA_MODEL
#include "model/cuda/cuda_backend.h"
#endif

ABSL_FLAG(std::string, cluster, "", "the cluster file (required)");
ABSL_FLAG(std::string, node, "", "this node's id in the cluster file (required)");
ABSL_FLAG(std::string, listen, "", "gRPC address (default: the node's grpc in the file)");
ABSL_FLAG(std::string, metrics, "", "Prometheus /metrics address (default: the file's; off: none)");
ABSL_FLAG(std::string, etcd, "",
          "etcd's client address (host:port): register there under a lease, for routers that "
          "follow etcd (empty: the cluster file is the membership)");
ABSL_FLAG(std::string, etcd_prefix, "/strata/", "the cluster's key prefix in etcd");
ABSL_FLAG(int, etcd_ttl_s, 6, "the registration lease, in seconds (renewed at half of it)");
ABSL_FLAG(std::string, ucx_tls, "", "UCX transports (UCX_TLS), e.g. tcp; empty: UCX's choice");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate this process presents to its gRPC peers, as server and as client "
          "(mutual TLS; scripts/make_certs.sh makes node.crt)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate: peers must present a certificate it signed, and servers are "
          "verified against it");
ABSL_FLAG(std::string, cluster_token_file, "",
          "file holding the cluster token: sent on every gRPC call, required of every call "
          "served (UNAUTHENTICATED otherwise)");
ABSL_FLAG(bool, insecure, false,
          "plaintext gRPC without a cluster token, instead of the four TLS flags (logged as a "
          "warning)");

ABSL_FLAG(std::string, device, "cpu",
          "where the node runs the model: cpu, or cuda[:N] (codecs with GPU pages: fp16, kivi, "
          "kcvt; the others say so at start)");
ABSL_FLAG(std::string, gpu_kv_bytes, "0",
          "with --device cuda: device memory for KV pages (e.g. 20G); 0: 90% of what is free "
          "once the weights are in");
ABSL_FLAG(int, gpu_max_sequences, 64,
          "with --device cuda: sequences holding a cache at once (each a window on the device)");

namespace strata::cluster {

absl::StatusOr<model::Device> NodeDeviceFromFlags() {
  absl::StatusOr<model::Device> device = model::ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok() || device->kind != model::Device::Kind::kCuda) return device;
#ifdef STRATA_WITH_CUDA_MODEL
  uint64_t kv_bytes = 0;
  if (!ParseByteSize(absl::GetFlag(FLAGS_gpu_kv_bytes), &kv_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("--gpu_kv_bytes: '",
                                                   absl::GetFlag(FLAGS_gpu_kv_bytes),
                                                   "' is not a byte count (e.g. 0, 512M, 20G)"));
  }
  const int sequences = absl::GetFlag(FLAGS_gpu_max_sequences);
  if (sequences < 1 || sequences > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu_max_sequences: ", sequences, " (1 to 65536)"));
  }
  model::SetCudaBackendLoader(
      [kv_bytes, sequences](const std::string& dir, const model::Device& d) {
        return model::cuda::LoadCudaBackend(
            dir, d, {.kv_pool_bytes = kv_bytes, .max_sequences = static_cast<uint32_t>(sequences)});
      });
#endif
  return device;
}

absl::StatusOr<std::shared_ptr<const kvstore::GrpcSecurity>> NodeSecurityFromFlags() {
  return LoadGrpcSecurity({.tls_cert = absl::GetFlag(FLAGS_tls_cert),
                           .tls_key = absl::GetFlag(FLAGS_tls_key),
                           .tls_ca = absl::GetFlag(FLAGS_tls_ca),
                           .cluster_token_file = absl::GetFlag(FLAGS_cluster_token_file),
                           .insecure = absl::GetFlag(FLAGS_insecure)});
}

}  // namespace strata::cluster
