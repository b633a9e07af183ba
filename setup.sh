#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks (idempotent: apt-get runs only when a
# package is missing), then configures and builds ember into build/.
# Usage: ./setup.sh [--sanitize] [--build-dir DIR]
set -euo pipefail
cd "$(dirname "$0")"
PKGS="build-essential cmake pkg-config librocksdb-dev libnng-dev libxxhash-dev libzstd-dev
      libopenblas-dev zlib1g-dev libmbedtls-dev openssl python3 python3-numpy iproute2
      gnuplot-nox"
missing=()
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
BUILD=build
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
    # ASan + UBSan cover host code; the CUDA backend is compiled in the plain build.
    --sanitize) EXTRA+=(-DEMBER_SANITIZE=ON -DEMBER_CUDA=OFF); BUILD=build-asan ;;
    --build-dir) BUILD="$2"; shift ;;
    *) echo "setup: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
# nvcc lives outside PATH on some installs; CUDA stays optional either way.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${EXTRA[@]}" >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
