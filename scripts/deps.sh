#!/usr/bin/env bash
# Installs the Debian 12 packages concerto needs, only those that are missing, and where the CUDA
# Toolkit is, the cuDNN frontend's headers.
set -euo pipefail
packages=(g++ cmake make pkg-config libz3-dev coinor-libcbc-dev libopenmpi-dev openmpi-bin librange-v3-dev
          libopenblas-dev nlohmann-json3-dev libcatch2-dev libcli11-dev python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"

install_packages() {
  # Catch2 v3 is only in bookworm-backports.
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "deb http://deb.debian.org/debian bookworm-backports main" | $sudo tee /etc/apt/sources.list.d/concerto-backports.list >/dev/null
  fi
  echo "concerto: installing ${missing[*]}" >&2
  $sudo apt-get update -q
  stable=() backports=()
  for p in "${missing[@]}"; do
    if [ "$p" = libcatch2-dev ]; then backports+=("$p"); else stable+=("$p"); fi
  done
  [ ${#stable[@]} -eq 0 ] || $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${stable[@]}"
  [ ${#backports[@]} -eq 0 ] || $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q -t bookworm-backports "${backports[@]}"
}
[ ${#missing[@]} -eq 0 ] || install_packages

# cuDNN's frontend (header-only; the fused attention of runtime/cuda/cudnn_attention.hpp) ships
# only on PyPI: its pinned wheel's include/ goes to a fixed place CMake looks in. Only where the
# CUDA Toolkit and cuDNN are; without pip or the network the build just lacks the fast path.
frontend_version=1.32.0
frontend_dir=/opt/concerto/cudnn-frontend
if [ -x /usr/local/cuda/bin/nvcc ] && [ -f /usr/local/cuda/include/cudnn.h ] &&
   [ "$(cat "$frontend_dir/version" 2>/dev/null)" != "$frontend_version" ]; then
  tmp=$(mktemp -d)
  # --only-binary: an sdist would be built (cmake, minutes) just to be unpacked.
  if python3 -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check --timeout 20 --retries 1 \
       -d "$tmp" "nvidia-cudnn-frontend==$frontend_version" >/dev/null 2>&1 &&
     python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [m for m in z.namelist() if m.startswith("include/")])' \
       "$tmp"/nvidia_cudnn_frontend-*.whl "$tmp/unpacked"; then
    $sudo rm -rf "$frontend_dir"
    $sudo mkdir -p "$frontend_dir"
    $sudo cp -r "$tmp/unpacked/include" "$frontend_dir/"
    echo "$frontend_version" | $sudo tee "$frontend_dir/version" >/dev/null
    echo "concerto: cuDNN frontend $frontend_version headers in $frontend_dir/include" >&2
  else
    echo "concerto: could not fetch nvidia-cudnn-frontend $frontend_version with pip; the GPU attention uses its own kernels only" >&2
  fi
  rm -rf "$tmp"
fi
