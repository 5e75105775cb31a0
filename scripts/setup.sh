#!/usr/bin/env bash
# Installs every Debian package Strata needs to build, test and run. Idempotent: when every
# package is already present it changes nothing and touches no network.
#
# CUDA 13 and NCCL are not Debian packages here; they come from /usr/local/cuda when present.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build ccache pkg-config git
  # fuzzers (libFuzzer ships with clang's runtime)
  clang libclang-rt-dev
  # libraries
  libabsl-dev libssl-dev nlohmann-json3-dev libopenblas-dev libre2-dev libboost-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  librocksdb-dev prometheus-cpp-dev curl
  # the shared KV tier on Redis Cluster: its client library, and the servers its tests start
  # (openssl makes the certificates of its TLS test)
  libhiredis-dev redis-server redis-tools openssl
  # the programs' malloc: jemalloc reuses freed large blocks where glibc maps and unmaps each
  # (common/allocator.h)
  libjemalloc-dev
  # AVX-512 instructions in portable code: the reference the 512-bit kernels' emulation is
  # tested against on machines without AVX-512
  libsimde-dev
  # membership (etcd v3; its JSON gateway) for the cluster tests
  etcd-server
  # separate hosts on one machine (deploy/netns: namespaces, veth, tc; packet loss by nftables
  # where the kernel has no netem)
  iproute2 nftables
  libucx-dev ucx-utils
  libgtest-dev libgmock-dev libbenchmark-dev
  # test oracles (run with Debian's /usr/bin/python3)
  python3 python3-cbor2 python3-regex
)
# deploy/k8s checks (scripts/validate_k8s.sh): `kubectl kustomize`, and Node.js with npm for the
# schema checks. Only when none is installed: another kubectl (the Google Cloud SDK's `kubectl`
# package) or Node.js (NodeSource's, which carries npm) owns the same files, and serves as well.
if ! command -v kubectl >/dev/null 2>&1; then packages+=(kubernetes-client); fi
if ! command -v npm >/dev/null 2>&1; then packages+=(nodejs npm); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${#missing[@]} packages: ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
