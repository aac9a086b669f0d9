#!/usr/bin/env bash
# Installs the Debian 12 packages concerto needs, only those that are missing.
set -euo pipefail
packages=(g++ cmake make pkg-config libz3-dev coinor-libcbc-dev libopenmpi-dev openmpi-bin librange-v3-dev
          libopenblas-dev nlohmann-json3-dev libcatch2-dev libcli11-dev python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
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
