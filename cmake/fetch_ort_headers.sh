#!/usr/bin/env bash
# Fetch ONNX Runtime's C/C++ headers (ORT pip wheels ship none).
# Downloads Debian trixie's libonnxruntime-dev through a private apt configuration that uses
# the mirror already configured on this machine, unpacks it with dpkg -x (never installs it)
# and prints the include directory. Usage: fetch_ort_headers.sh DEST_DIR
set -euo pipefail
dest=${1:?usage: fetch_ort_headers.sh DEST_DIR}
inc="$dest/root/usr/include/onnxruntime"
if [ -f "$inc/onnxruntime_c_api.h" ]; then echo "$inc"; exit 0; fi

mirror=$( { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
  /etc/apt/sources.list.d/*.list 2>/dev/null || true; } \
  | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n 1 | tr -d ' ')
mirror=${mirror:-http://deb.debian.org/debian}
apt_dir="$dest/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/etc" "$dest/debs"
echo "deb [trusted=yes] $mirror trixie main" > "$apt_dir/etc/sources.list"
touch "$apt_dir/status"
opts=(-o "Dir::Etc::SourceList=$apt_dir/etc/sources.list" -o "Dir::Etc::SourceParts=-"
      -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::State::Status=$apt_dir/status"
      -o "Dir::Cache=$apt_dir/cache" -o "APT::Architecture=amd64"
      -o "Acquire::Languages=none" -o "Debug::NoLocking=1")
echo "fetch_ort_headers: apt update from $mirror (trixie)" >&2
apt-get "${opts[@]}" update >&2
(cd "$dest/debs" && apt-get "${opts[@]}" download libonnxruntime-dev >&2)
dpkg -x "$dest"/debs/libonnxruntime-dev_*.deb "$dest/root"
[ -f "$inc/onnxruntime_c_api.h" ] || { echo "fetch_ort_headers: no headers in package" >&2; exit 1; }
echo "$inc"
