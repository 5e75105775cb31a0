#!/usr/bin/env bash
# Makes the certificates and the cluster token a Strata cluster runs with (docs/deploy.md,
# "Security"), with openssl:
#   scripts/make_certs.sh OUTDIR [--san IP_OR_DNS]... [--days N]
#
#   OUTDIR/ca.crt, ca.key          the cluster's CA (keep ca.key off the nodes)
#   OUTDIR/node.crt, node.key      every process's gRPC identity, server and client (EKU serverAuth
#                                  + clientAuth): --tls_cert, --tls_key; --tls_ca is ca.crt
#   OUTDIR/router-http.crt, .key   the router's HTTPS certificate (--http_tls_cert, --http_tls_key)
#   OUTDIR/cluster.token           the cluster token (--cluster_token_file), 64 hex characters
#
# Every certificate names 127.0.0.1, ::1 and localhost, plus each --san (an IP address or a DNS
# name: the addresses peers dial, e.g. 10.77.0.2 in a network namespace, or a host name). Keys and
# the token are mode 0600. Existing files in OUTDIR are replaced.
set -euo pipefail

usage() { sed -n '2,16p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
out="$1"; shift
days=825
sans=("IP:127.0.0.1" "IP:::1" "DNS:localhost")
while [ $# -gt 0 ]; do
  case "$1" in
    --san)
      [ $# -ge 2 ] || usage
      # An IPv4 or IPv6 literal is an IP SAN; anything else a DNS name.
      if [[ "$2" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$2" == *:* ]]; then
        sans+=("IP:$2")
      else
        sans+=("DNS:$2")
      fi
      shift ;;
    --days) days="$2"; shift ;;
    -h|--help) usage ;;
    *) echo "make_certs.sh: unknown argument '$1'" >&2; usage ;;
  esac
  shift
done
command -v openssl >/dev/null || { echo "make_certs.sh: openssl is not installed" >&2; exit 1; }

mkdir -p "$out"
umask 077
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
san_line="subjectAltName=$(IFS=,; echo "${sans[*]}")"

openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$out/ca.key" 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha256 -days "$days" -subj "/O=Strata/CN=Strata cluster CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$out/ca.crt"

# issue NAME CN EKU: NAME.key and NAME.crt signed by the CA.
issue() {
  local name="$1" cn="$2" eku="$3"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$out/$name.key" 2>/dev/null
  openssl req -new -key "$out/$name.key" -subj "/O=Strata/CN=$cn" -out "$tmp/$name.csr"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    echo "$san_line"
  } >"$tmp/$name.ext"
  openssl x509 -req -in "$tmp/$name.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -CAserial "$tmp/ca.srl" -days "$days" -sha256 -extfile "$tmp/$name.ext" \
    -out "$out/$name.crt" 2>/dev/null
}
issue node "strata-node" "serverAuth,clientAuth"
issue router-http "strata-router" "serverAuth"

openssl rand -hex 32 >"$out/cluster.token"
chmod 600 "$out"/*.key "$out/cluster.token"
chmod 644 "$out"/*.crt
echo "make_certs.sh: $out: ca.crt, node.crt/.key, router-http.crt/.key, cluster.token (SANs: ${sans[*]})"
