"""Fixtures that run the REAL binaries (``inferencecache-server``, the sidecar, the fake engine).

The binaries come from the workspace's ``target/debug`` (``cargo build -p inferencecache-server
-p inferencecache-sidecar`` first; ``clients/python/ci.sh`` does) or from the paths in
``INFERENCECACHE_SERVER_BIN`` / ``INFERENCECACHE_SIDECAR_BIN`` / ``INFERENCECACHE_FAKE_ENGINE_BIN``.
Every process binds loopback ports only and is stopped by its own PID.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import socket
import subprocess
import time
import urllib.request
from typing import Iterator, List, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def binary(env: str, name: str) -> pathlib.Path:
    path = pathlib.Path(os.environ.get(env, REPO / "target" / "debug" / name))
    if not path.is_file():
        pytest.fail(f"{path} not found: run `cargo build -p inferencecache-server -p inferencecache-sidecar` or set {env}")
    return path


def server_bin() -> pathlib.Path:
    return binary("INFERENCECACHE_SERVER_BIN", "inferencecache-server")


def sidecar_bin() -> pathlib.Path:
    return binary("INFERENCECACHE_SIDECAR_BIN", "inferencecache-sidecar")


def fake_engine_bin() -> pathlib.Path:
    return binary("INFERENCECACHE_FAKE_ENGINE_BIN", "inferencecache-fake-engine")


_GIVEN_PORTS: set = set()


def free_port() -> int:
    """A free loopback port (free when asked; the caller binds it soon after), never one this
    test session was given before: the OS may offer a just-released port again, and two
    listeners of one server given the same port would fail to start."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


def stop(process: subprocess.Popen) -> None:
    """Stops one process we started (SIGTERM, then SIGKILL after 10 s)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclasses.dataclass
class Server:
    process: subprocess.Popen
    grpc_port: int
    http_port: int
    control_port: int
    log: pathlib.Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(tmp: pathlib.Path, extra: Optional[List[str]] = None) -> Server:
    return start_server_on(tmp, (free_port(), free_port(), free_port()), extra)


def start_server_on(tmp: pathlib.Path, ports, extra: Optional[List[str]] = None) -> Server:
    """A server on the given (gRPC, HTTP, control) ports, ready when this returns."""
    grpc_port, http_port, control_port = ports
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "server.log"
    process = subprocess.Popen(
        [
            str(server_bin()),
            "--grpc-bind-address", f"127.0.0.1:{grpc_port}",
            "--http-bind-address", f"127.0.0.1:{http_port}",
            "--snapshot-bind-address", f"127.0.0.1:{control_port}",
            "--log-level", "warn",
            *(extra or []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    server = Server(process, grpc_port, http_port, control_port, log)
    wait_ready(server)
    return server


def wait_ready(server: Server) -> None:
    """Waits for ``/readyz`` (fails the test, stopping the server, after 30 s or on exit)."""
    deadline = time.monotonic() + 30
    while True:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}: {server.logs()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/readyz", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(server.process)
            pytest.fail(f"server not ready after 30 s: {server.logs()}")
        time.sleep(0.05)


@pytest.fixture()
def server(tmp_path: pathlib.Path) -> Iterator[Server]:
    """A fresh server (empty index) per test."""
    srv = start_server(tmp_path)
    try:
        yield srv
    finally:
        stop(srv.process)
