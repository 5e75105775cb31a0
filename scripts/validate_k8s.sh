#!/usr/bin/env bash
# Checks the Kubernetes manifests in deploy/k8s without a cluster: renders the base and every
# overlay with `kubectl kustomize`, and checks every document it renders (tests/k8s/validate.js)
# against the Kubernetes schema of its kind (a kind without one is an error), for fields no schema
# has, and for what schemas do not see: Service selectors and ports, ConfigMaps and Secrets
# referred to, probe ports, $(VAR)s in flags, files the flags name in mounted ConfigMaps and
# Secrets, the cluster file's addresses and the shared tier's (STRATA_SHARED_TIER), the house
# rules (non-root, read-only root file system, requests and limits). The kustomization files must
# stay within what kustomize v2.0.3 (Debian's kubectl 1.20) reads. Then the check that the checks
# can fail: tests/k8s/good.yaml must pass, and every tests/k8s/bad/*.yaml and
# bad/*/kustomization.yaml (each broken in one way) must be rejected with the errors it names.
#
#   scripts/validate_k8s.sh        (KUBECTL=/path/to/kubectl to use another kubectl)
#
# Needs kubectl, Node.js and npm (scripts/setup.sh installs them); installs its npm packages
# (tests/k8s/package-lock.json) into tests/k8s/node_modules on first use. One line per check;
# the last line counts them; exit status 1 when any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
kubectl="${KUBECTL:-kubectl}"

for tool in "$kubectl" node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "validate_k8s: $tool is not installed (scripts/setup.sh installs it)" >&2
    exit 1
  fi
done
if ! "$kubectl" kustomize --help >/dev/null 2>&1; then
  echo "validate_k8s: '$kubectl kustomize' does not work: kubectl 1.14 or later is needed" >&2
  exit 1
fi

# The npm packages, as the lock file pins them; installed again when the lock file changes.
stamp=tests/k8s/node_modules/.strata-package-lock.json
if ! cmp -s tests/k8s/package-lock.json "$stamp"; then
  echo "validate_k8s: npm ci --prefix tests/k8s"
  npm ci --prefix tests/k8s --no-audit --no-fund --loglevel=error
  cp tests/k8s/package-lock.json "$stamp"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
version="$("$kubectl" version --client 2>/dev/null | grep -oE 'v[0-9]+\.[0-9]+\.[0-9]+' | head -n 1 || true)"
echo "validate_k8s: kubectl ${version:-(version unknown)} ($(command -v "$kubectl")), node $(node --version)"

passed=0
failed=0
result() {  # result STATUS: count a check
  if [ "$1" = 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
}

for dir in deploy/k8s/base deploy/k8s/overlays/*/; do
  dir="${dir%/}"
  [ -f "$dir/kustomization.yaml" ] || continue
  status=0
  node tests/k8s/validate.js --kustomization "$dir" >"$work/syntax" || status=$?
  if [ "$status" != 0 ]; then cat "$work/syntax"; result 1; continue; fi
  out="$work/$(echo "$dir" | tr / _).yaml"
  if ! "$kubectl" kustomize "$dir" >"$out" 2>"$work/stderr"; then
    echo "FAIL $dir: kubectl kustomize failed:"
    sed 's/^/    /' "$work/stderr"
    result 1
    continue
  fi
  status=0
  node tests/k8s/validate.js --label "$dir" "$out" || status=$?
  result "$status"
done

status=0
node tests/k8s/validate.js --label tests/k8s/good.yaml tests/k8s/good.yaml || status=$?
result "$status"
for bad in tests/k8s/bad/*.yaml tests/k8s/bad/*/; do
  status=0
  node tests/k8s/validate.js --expect-reject "${bad%/}" || status=$?
  result "$status"
done

echo "validate_k8s: $passed passed, $failed failed"
[ "$failed" = 0 ] && [ "$passed" -gt 0 ]
