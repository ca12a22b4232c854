#!/usr/bin/env bash
# Runs a command inside an image's exported root filesystem the way a container runtime would
# (deploy/image/assemble.sh makes the root filesystems):
#
#   deploy/image/run-rootfs.sh ROOTFS STATE_DIR -- /usr/local/bin/inferencecache-server ARGS…
#
# New mount, PID, IPC and UTS namespaces (the host network, so the caller reaches its loopback
# listeners); the root filesystem bind-mounted read-only (readOnlyRootFilesystem); a fresh
# /proc for the new PID namespace; tmpfs /tmp; /dev/null, /dev/zero, /dev/random and
# /dev/urandom; STATE_DIR (may be "") at /var/lib/inferencecache; then chroot into it as UID and
# GID 65532 with no supplementary groups. Nothing of the host's filesystem is visible inside
# except those device nodes and STATE_DIR. Needs root (CAP_SYS_ADMIN, CAP_SYS_CHROOT).
set -euo pipefail
root="$(cd "${1:?usage: run-rootfs.sh ROOTFS STATE_DIR -- COMMAND…}" && pwd)"
state="${2-}"
[ "${3-}" = "--" ] || { echo "run-rootfs.sh: expected -- before the command" >&2; exit 2; }
shift 3
exec unshare --mount --pid --ipc --uts --fork --propagation private /bin/bash -c '
set -euo pipefail
root="$1"; state="$2"; shift 2
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"
mount -t proc proc "$root/proc"
mount -t tmpfs -o mode=1777,size=64m tmpfs "$root/tmp"
for node in null zero random urandom; do mount --bind "/dev/$node" "$root/dev/$node"; done
if [ -n "$state" ]; then mount --bind "$state" "$root/var/lib/inferencecache"; fi
exec chroot --userspec=65532:65532 --groups=65532 "$root" "$@"
' run-rootfs "$root" "$state" "$@"
