#!/usr/bin/env bash
# Builds a base image for the Dockerfile (its BASE_IMAGE) from Debian's packages alone, for
# machines that reach Debian's package mirror but not Docker Hub: Debian bookworm (minbase) with
# its Python 3.11, venv and `python`, as a root filesystem tarball for `podman import` or
# `docker import`. The machine's own extra CA certificates (/usr/local/share/ca-certificates) go
# in too, and pip is told to use the system trust store, so that `pip install` in the build
# reaches PyPI wherever the machine itself does.
#
#   tools/build-base-image.sh OUT.tar
#   podman import OUT.tar localhost/picker-base:bookworm
#   make image CONTAINER_ENGINE=podman BASE_IMAGE=localhost/picker-base:bookworm
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUT.tar (a root filesystem tarball for podman/docker import)" >&2
  exit 2
fi
out="$1"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

command -v mmdebstrap >/dev/null || {
  echo "$0: mmdebstrap is needed (Debian: apt-get install mmdebstrap)" >&2; exit 1; }

hooks=()
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  hooks+=(--customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share')
  hooks+=(--customize-hook='chroot "$1" update-ca-certificates >/dev/null 2>&1')
fi
# pip vendors its own CA bundle unless told otherwise.
hooks+=(--customize-hook='printf "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n" > "$1/etc/pip.conf"')

mkdir -p "$(dirname "$out")"
# Written beside the target and renamed, so an interrupted build never leaves a partial tarball.
mmdebstrap --quiet --variant=minbase \
  --include=python3.11,python3.11-venv,python-is-python3,ca-certificates \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  "${hooks[@]}" bookworm "$out.tmp.tar" "$MIRROR"
mv "$out.tmp.tar" "$out"
echo "base image root filesystem: $out"
