"""The container images' runtime layout runs (``deploy/Dockerfile``; issue 46).

``deploy/image/assemble.sh`` builds, with podman and ``FROM scratch`` (nothing pulled), the
layout of the Dockerfile's distroless runtime stage around the binaries this machine built: the
binary, the shared libraries ``ldd`` names and the loader, CA certificates, passwd/group with
``nonroot`` 65532, no shell; and exports each image's root filesystem. ``podman run`` fails here
(crun cannot set the rlimits; cgroups v1), so ``deploy/image/run-rootfs.sh`` runs the exported
root filesystem as a runtime would: new mount/PID/IPC/UTS namespaces, the root read-only, a
fresh /proc, chroot as UID/GID 65532.

What this proves: the image's files alone (no host library, no shell) run the server and the
sidecar as 65532 on a read-only root; the server answers gRPC health and a lookup from inside
it; the sidecar inside its image reports a fake engine's blocks to it; the server writes its
checkpoint to the state volume as 65532 and a new container on that volume answers from it.
What it does not: the release build (the debug binaries ``cargo test`` builds are used; both
link the same libc, libm and libgcc_s), the official base images' bytes (nothing is pulled),
cgroup limits.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import time
from typing import List

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import REPO, Server, fake_engine_bin, free_port, server_bin, sidecar_bin, stop, wait_ready
from inferencecache import Producer, Router

IMAGE = REPO / "deploy" / "image"
SHELLS = {"sh", "bash", "dash", "ash", "busybox", "zsh"}
UID = 65532


def prerequisites() -> None:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (mount and PID namespaces, chroot)")
    for tool in ("unshare", "chroot", "ldd"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if os.environ.get("CI") and shutil.which("podman") is None:
        missing.append("podman (.ci/run installs it)")
    if missing:
        message = f"image check needs {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> pathlib.Path:
    prerequisites()
    out = tmp_path_factory.mktemp("image")
    env = dict(os.environ, SERVER_BIN=str(server_bin()), SIDECAR_BIN=str(sidecar_bin()))
    subprocess.run(["bash", str(IMAGE / "assemble.sh"), str(out)], check=True, env=env, timeout=300)
    return out


def config(images: pathlib.Path, target: str) -> dict:
    return json.loads((images / f"image-{target}.json").read_text())[0]["Config"]


@pytest.mark.parametrize("target", ["server", "sidecar"])
def test_image_layout_is_distroless_and_nonroot(images, target):
    root = images / f"image-{target}"
    binary = f"/usr/local/bin/inferencecache-{target}"
    cfg = config(images, target)
    assert cfg["User"] == f"{UID}:{UID}"
    assert cfg["Entrypoint"] == [binary]
    files = sorted("/" + str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink())
    assert not [f for f in files if pathlib.PurePath(f).name in SHELLS], "no shell in the image"
    libraries = [f for f in files if "/lib" in f]
    assert any(f.endswith("/libc.so.6") for f in libraries) and any("ld-linux" in f for f in libraries)
    # Nothing else: the binary, its libraries, the CA bundle, passwd/group, device mount points.
    others = set(files) - set(libraries) - {binary, "/etc/passwd", "/etc/group", "/etc/ssl/certs/ca-certificates.crt"}
    assert others == {"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"}
    assert f"nonroot:x:{UID}:{UID}:" in (root / "etc" / "passwd").read_text()
    home = (root / "home" / "nonroot").stat()
    assert (home.st_uid, home.st_gid) == (UID, UID)


def descendants(pid: int) -> List[int]:
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        try:
            children = (pathlib.Path(f"/proc/{current}/task/{current}/children")).read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.append(child)
            queue.append(child)
    return found


def contained(runner: subprocess.Popen, root: pathlib.Path, timeout: float = 10) -> int:
    """The PID (host view) of the process ``run-rootfs.sh`` started inside ``root``."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in descendants(runner.pid):
            try:
                if os.readlink(f"/proc/{pid}/root") == str(root):
                    return pid
            except OSError:
                pass
        assert runner.poll() is None and time.monotonic() < deadline, "no process inside the image"
        time.sleep(0.05)


def assert_runs_as_nonroot_on_a_read_only_root(pid: int) -> None:
    status = dict(line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Uid"].split() == [str(UID)] * 4
    assert status["Gid"].split() == [str(UID)] * 4
    assert status["Groups"].split() == [str(UID)]
    (root_mount,) = [l for l in pathlib.Path(f"/proc/{pid}/mountinfo").read_text().splitlines() if l.split()[4] == "/"]
    assert "ro" in root_mount.split()[5].split(","), root_mount


def run_in_image(root: pathlib.Path, state: str, args: List[str], log: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(IMAGE / "run-rootfs.sh"), str(root), state, "--", *args],
        stdout=subprocess.DEVNULL, stderr=log.open("ab"),
    )


def stop_contained(runner: subprocess.Popen, pid: int) -> None:
    """SIGTERM to the contained process (unshare does not forward signals), then wait."""
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        pass
    try:
        runner.wait(timeout=20)
    except subprocess.TimeoutExpired:
        stop(runner)


def test_server_and_sidecar_run_from_their_images(images, tmp_path):
    server_root, sidecar_root = images / "image-server", images / "image-sidecar"
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, UID, UID)  # the volume as the StatefulSet's fsGroup leaves it
    ports = (free_port(), free_port(), free_port())
    server_args = [
        "/usr/local/bin/inferencecache-server",
        f"--grpc-bind-address=127.0.0.1:{ports[0]}",
        f"--http-bind-address=127.0.0.1:{ports[1]}",
        f"--snapshot-bind-address=127.0.0.1:{ports[2]}",
        "--state-dir=/var/lib/inferencecache",
        "--log-format=json",
    ]
    log = tmp_path / "server.log"
    runner = run_in_image(server_root, str(state), server_args, log)
    engine = sidecar_runner = None
    server_pid = sidecar_pid = None
    try:
        server_pid = contained(runner, server_root)
        server = Server(runner, *ports, log)
        wait_ready(server)
        assert_runs_as_nonroot_on_a_read_only_root(server_pid)
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        # The sidecar from its image, fed by a fake engine on the host's loopback.
        engine_port, metrics_port = free_port(), free_port()
        engine = subprocess.Popen(
            [str(fake_engine_bin()), "--bind", f"tcp://127.0.0.1:{engine_port}", "--topic", "",
             "--block-size", "16", "--num-blocks", "8", "--events", "2", "--interval", "200ms"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "engine.log").open("wb"),
        )
        sidecar_log = tmp_path / "sidecar.log"
        sidecar_runner = run_in_image(sidecar_root, "", [
            "/usr/local/bin/inferencecache-sidecar",
            f"--engine-endpoint=tcp://127.0.0.1:{engine_port}",
            f"--server={server.target}",
            "--replica-id=vllm-0", "--tenant-id=team-a", "--model-id=llama",
            f"--metrics-bind-address=127.0.0.1:{metrics_port}",
            f"--engine-metrics-url=http://127.0.0.1:{free_port()}/metrics",
        ], sidecar_log)
        sidecar_pid = contained(sidecar_runner, sidecar_root)
        assert_runs_as_nonroot_on_a_read_only_root(sidecar_pid)
        deadline = time.monotonic() + 30
        with Router(server.target, timeout=5) as router:
            while True:
                result = router.lookup("llama", tenant_id="team-a", token_ids=list(range(128)))
                if result.hit:
                    break
                assert sidecar_runner.poll() is None, sidecar_log.read_text()
                assert time.monotonic() < deadline, f"{result}\n{sidecar_log.read_text()}"
                time.sleep(0.2)
        assert [(s.replica_id, s.matched_tokens) for s in result.replica_scores] == [("vllm-0", 128)]
        stop_contained(sidecar_runner, sidecar_pid)

        # A producer's chain, then a rollout: the checkpoint lands on the volume as 65532, and
        # a new container on the same volume answers from it.
        kept = [5000 + i for i in range(64)]
        with Producer(server.target, replica_id="vllm-1", model_id="llama", tenant_id="team-a") as producer:
            assert producer.report_token_chains([kept], timeout=5).accepted
        stop_contained(runner, server_pid)
        assert runner.returncode == 0, log.read_text()
        checkpoints = sorted(state.iterdir())
        assert checkpoints and all((p.stat().st_uid, p.stat().st_gid) == (UID, UID) for p in checkpoints)
        runner = run_in_image(server_root, str(state), server_args, log)
        server_pid = contained(runner, server_root)
        server = Server(runner, *ports, log)
        wait_ready(server)
        with Router(server.target, timeout=5) as router:
            result = router.lookup("llama", tenant_id="team-a", token_ids=kept)
        assert [(s.replica_id, s.matched_tokens) for s in result.replica_scores] == [("vllm-1", 64)], log.read_text()
    finally:
        if sidecar_runner is not None and sidecar_runner.poll() is None:
            if sidecar_pid is not None:
                stop_contained(sidecar_runner, sidecar_pid)
            else:
                stop(sidecar_runner)
        if engine is not None:
            stop(engine)
        if runner.poll() is None:
            if server_pid is not None:
                stop_contained(runner, server_pid)
            else:
                stop(runner)
