#!/usr/bin/env bash
# Assembles the runtime layout of deploy/Dockerfile's images from what this machine produces,
# builds it as OCI images with podman (FROM scratch: nothing is pulled) and exports each image's
# root filesystem, for deploy/image/run-rootfs.sh to run (podman run itself fails here: crun
# cannot set the rlimits and cgroups v1 is not supported rootless).
#
#   deploy/image/assemble.sh OUT
#
# Writes OUT/image-server/ and OUT/image-sidecar/ (the exported root filesystems) and
# OUT/image-server.json, OUT/image-sidecar.json (`podman image inspect`: user, entrypoint).
# The binaries are SERVER_BIN / SIDECAR_BIN (default: the debug builds `cargo test` leaves in
# target/debug; the release build links the same libraries). Without podman the assembled
# directory stands in for the image (a notice says so); in CI (CI set) podman is required.
set -euo pipefail
out="${1:?usage: assemble.sh OUT}"
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
server_bin="${SERVER_BIN:-$repo/target/debug/inferencecache-server}"
sidecar_bin="${SIDECAR_BIN:-$repo/target/debug/inferencecache-sidecar}"
mkdir -p "$out"

# One root filesystem: the binary, the libraries and loader it needs (ldd), and what distroless
# cc's `nonroot` variant holds besides: CA certificates, passwd/group, /tmp (/home/nonroot, owned
# by 65532, comes from the Containerfile's COPY --chown).
assemble() {
  local binary="$1" root="$2"
  rm -rf "$root"
  mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/tmp" "$root/home" \
    "$root/proc" "$root/dev" "$root/var/lib/inferencecache"
  install -m 0755 "$binary" "$root/usr/local/bin/$(basename "$binary")"
  # `libx.so => /path (addr)` lines and the loader's own `/lib64/ld-linux… (addr)` line.
  ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  fi
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$root/etc/group"
  # Mount points for the device nodes a container runtime provides.
  for node in null zero random urandom; do : >"$root/dev/$node"; done
  chmod 1777 "$root/tmp"
  # The state volume's mount point (the volume brings its own owner, fsGroup 65532).
}

assemble "$server_bin" "$out/rootfs-server"
install -d -m 0700 "$out/nonroot-home"
assemble "$sidecar_bin" "$out/rootfs-sidecar"

podman_works=false
if command -v podman >/dev/null 2>&1; then
  podman_works=true
elif [ -n "${CI:-}" ]; then
  echo "assemble.sh: podman is required in CI (.ci/run installs it)" >&2
  exit 1
else
  echo "assemble.sh: notice: no podman; the assembled directories stand in for the images" >&2
fi

for target in server sidecar; do
  rm -rf "$out/image-$target"
  mkdir -p "$out/image-$target"
  if $podman_works; then
    tag="localhost/inferencecache-check/$target:$$"
    cp "$here/Containerfile" "$out/Containerfile"
    podman build --quiet --target "$target" -t "$tag" -f "$out/Containerfile" "$out" >/dev/null
    podman image inspect "$tag" >"$out/image-$target.json"
    container="$(podman create "$tag")"
    podman export "$container" | tar -x -C "$out/image-$target" --same-owner --numeric-owner
    podman rm "$container" >/dev/null
    podman rmi "$tag" >/dev/null
  else
    cp -a "$out/rootfs-$target/." "$out/image-$target/"
    install -d -m 0700 -o 65532 -g 65532 "$out/image-$target/home/nonroot"
    printf '[{"Config": {"User": "65532:65532", "Entrypoint": ["/usr/local/bin/inferencecache-%s"]}}]\n' "$target" >"$out/image-$target.json"
  fi
done
echo "$out"
