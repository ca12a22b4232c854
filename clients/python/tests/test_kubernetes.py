"""``deploy/kubernetes/`` manifests: valid against the Kubernetes schemas (offline, strict), and
every argument they give the server and the sidecar is accepted by the real binaries.

The server Deployment runs with its own arguments, ConfigMap and Secret (mounted paths mapped to
temporary files, bind addresses moved to free loopback ports); its gRPC health check must be
SERVING and its control listener must refuse a request without the controller token. The vLLM
pod's sidecar then runs with its own arguments (the downward-API variables expanded as the
kubelet would, the engine replaced by the fake engine) and a lookup must find the fake engine's
blocks under the pod's name and namespace. The replicated manifest's NATS and two of its servers
run with their own arguments too, and must converge.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import time
import urllib.error
import urllib.request
from typing import Dict, List

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import REPO, Server, fake_engine_bin, free_port, server_bin, sidecar_bin, stop, wait_ready
from inferencecache import Producer, Router

MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.33.0"
POD_NAME, POD_NAMESPACE = "vllm-llama-7d9f-x2k4q", "team-a"


def documents() -> List[dict]:
    docs = []
    for path in MANIFESTS:
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def find(kind: str, name: str) -> dict:
    matches = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}"
    return matches[0]


def container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def test_manifests_exist():
    assert {p.name for p in MANIFESTS} >= {"server.yaml", "vllm-with-sidecar.yaml", "replicated.yaml"}


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f'{d["kind"]}/{d["metadata"]["name"]}')
def test_schema_valid_strict(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_server_probes_are_grpc_and_control_is_internal():
    deployment = find("Deployment", "inferencecache")
    server = container(deployment, "server")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"]["port"] == 9090, probe
    public = find("Service", "inferencecache")
    assert sorted(p["port"] for p in public["spec"]["ports"]) == [8080, 9090], "no control port on the public Service"
    policy = find("NetworkPolicy", "inferencecache-control-internal")
    control_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == 8081 for p in r["ports"])]
    assert control_rules and all(r.get("from") for r in control_rules), "8081 only from selected pods"
    assert "--controller-token-file=/etc/inferencecache/tokens/controller" in server["args"]


def test_sidecar_identity_comes_from_the_downward_api():
    sidecar = container(find("Deployment", "vllm-llama"), "inferencecache-sidecar")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert "--replica-id=$(POD_NAME)" in sidecar["args"]
    assert "--tenant-id=$(POD_NAMESPACE)" in sidecar["args"]


def mounted_files(deployment: dict, name: str, root: pathlib.Path) -> Dict[str, pathlib.Path]:
    """Writes the ConfigMaps and Secrets a container mounts under ``root``; returns the
    in-pod path → local path map (longest prefix first)."""
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mapping: Dict[str, pathlib.Path] = {}
    for mount in container(deployment, name).get("volumeMounts", []):
        volume = volumes[mount["name"]]
        local = root / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            data = find("ConfigMap", volume["configMap"]["name"])["data"]
        else:
            data = find("Secret", volume["secret"]["secretName"])["stringData"]
            items = volume["secret"].get("items")
            if items:
                data = {i["path"]: data[i["key"]] for i in items}
        for key, value in data.items():
            (local / key).write_text(value + ("\n" if not value.endswith("\n") else ""))
        mapping[mount["mountPath"]] = local
    return mapping


def localize(args: List[str], mapping: Dict[str, pathlib.Path], replace: Dict[str, str]) -> List[str]:
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        if eq and flag in replace:
            value = replace[flag]
        for pod_path, local in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
            if value.startswith(pod_path + "/"):
                value = str(local) + value[len(pod_path):]
        out.append(f"{flag}={value}" if eq else arg)
    return out


def test_manifest_arguments_run_on_the_real_binaries(tmp_path):
    deployment = find("Deployment", "inferencecache")
    grpc_port, http_port, control_port = free_port(), free_port(), free_port()
    args = localize(
        container(deployment, "server")["args"],
        mounted_files(deployment, "server", tmp_path / "server"),
        {
            "--grpc-bind-address": f"127.0.0.1:{grpc_port}",
            "--http-bind-address": f"127.0.0.1:{http_port}",
            "--snapshot-bind-address": f"127.0.0.1:{control_port}",
        },
    )
    log = tmp_path / "server.log"
    process = subprocess.Popen([str(server_bin()), *args], stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    server = Server(process, grpc_port, http_port, control_port, log)
    engine = sidecar = None
    try:
        wait_ready(server)
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{server.control_url}/snapshot", timeout=5)
        assert refused.value.code == 401
        token = find("Secret", "inferencecache-tokens")["stringData"]["controller"]
        request = urllib.request.Request(f"{server.control_url}/snapshot", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.status == 200

        # The sidecar with the vLLM pod's arguments, next to a fake engine on the same topic.
        pod = find("Deployment", "vllm-llama")
        spec = container(pod, "inferencecache-sidecar")
        engine_port = free_port()
        topic = next(a.split("=", 1)[1] for a in spec["args"] if a.startswith("--topic="))
        engine = subprocess.Popen(
            [str(fake_engine_bin()), "--bind", f"tcp://127.0.0.1:{engine_port}", "--topic", topic,
             "--block-size", "16", "--num-blocks", "8", "--events", "2", "--interval", "200ms"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "engine.log").open("wb"),
        )
        sidecar_args = [
            a.replace("$(POD_NAME)", POD_NAME).replace("$(POD_NAMESPACE)", POD_NAMESPACE)
            for a in localize(
                spec["args"],
                mounted_files(pod, "inferencecache-sidecar", tmp_path / "sidecar"),
                {
                    "--server": server.target,
                    "--engine-endpoint": f"tcp://127.0.0.1:{engine_port}",
                    "--engine-metrics-url": f"http://127.0.0.1:{free_port()}/metrics",
                },
            )
        ]
        sidecar_log = tmp_path / "sidecar.log"
        sidecar = subprocess.Popen([str(sidecar_bin()), *sidecar_args], stdout=subprocess.DEVNULL, stderr=sidecar_log.open("wb"))
        model = next(a.split("=", 1)[1] for a in spec["args"] if a.startswith("--model-id="))
        deadline = time.monotonic() + 30
        with Router(server.target, timeout=5) as router:
            while True:
                assert sidecar.poll() is None, f"sidecar exited {sidecar.returncode}: {sidecar_log.read_text()}"
                result = router.lookup(model, tenant_id=POD_NAMESPACE, token_ids=list(range(128)))
                if result.hit:
                    break
                assert time.monotonic() < deadline, f"no hit: {result}\n{sidecar_log.read_text()}"
                time.sleep(0.2)
        assert [(s.replica_id, s.matched_tokens) for s in result.replica_scores] == [(POD_NAME, 128)]
    finally:
        for p in (sidecar, engine, process):
            if p is not None:
                stop(p)


def nats_server_bin() -> pathlib.Path:
    """Debian's ``nats-server`` (``.ci/run`` installs it); the test is skipped without it."""
    for candidate in ("/usr/sbin/nats-server", "/usr/bin/nats-server"):
        if pathlib.Path(candidate).exists():
            return pathlib.Path(candidate)
    pytest.skip("nats-server is not installed")


def digest(server: Server, token: str) -> dict:
    request = urllib.request.Request(f"{server.control_url}/digest", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as reply:
        return json.loads(reply.read())


def test_replicated_manifest_runs_two_servers_that_converge_through_its_nats(tmp_path):
    """NATS with the StatefulSet's arguments (its token from the Secret, bound to loopback), then
    two index servers with the replicated Deployment's arguments (pod names expanded, the NATS
    Service mapped to the local NATS): an update sent to one is answered by the other, and both
    report the same digest."""
    nats_set = find("StatefulSet", "inferencecache-nats")
    nats_container = nats_set["spec"]["template"]["spec"]["containers"][0]
    nats_token = find("Secret", "inferencecache-nats-token")["stringData"]["token"]
    (data_mount,) = nats_container["volumeMounts"]
    assert f"--store_dir={data_mount['mountPath']}" in nats_container["args"], "JetStream stores on the volume"
    nats_port = free_port()
    nats_args = [
        a.replace("$(NATS_TOKEN)", nats_token)
        for a in localize(
            nats_container["args"],
            {},
            {
                "--store_dir": str(tmp_path / "nats"),
                "--port": str(nats_port),
                "--http_port": str(free_port()),
            },
        )
    ]
    (tmp_path / "nats").mkdir()
    nats = subprocess.Popen(
        [str(nats_server_bin()), "--addr=127.0.0.1", *nats_args],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "nats.log").open("wb"),
    )
    deployment = find("Deployment", "inferencecache-replicated")
    servers: List[Server] = []
    try:
        for pod in ("inferencecache-replicated-7c9d-a1", "inferencecache-replicated-7c9d-b2"):
            grpc_port, http_port, control_port = free_port(), free_port(), free_port()
            args = [
                a.replace("$(POD_NAME)", pod)
                for a in localize(
                    container(deployment, "server")["args"],
                    mounted_files(deployment, "server", tmp_path / pod),
                    {
                        "--grpc-bind-address": f"127.0.0.1:{grpc_port}",
                        "--http-bind-address": f"127.0.0.1:{http_port}",
                        "--snapshot-bind-address": f"127.0.0.1:{control_port}",
                        "--nats-url": f"nats://127.0.0.1:{nats_port}",
                    },
                )
            ]
            log = tmp_path / f"{pod}.log"
            process = subprocess.Popen([str(server_bin()), *args], stdout=subprocess.DEVNULL, stderr=log.open("wb"))
            servers.append(Server(process, grpc_port, http_port, control_port, log))
        for server in servers:
            wait_ready(server)
        tokens = find("Secret", "inferencecache-tokens")["stringData"]
        tokens_in = list(range(64))
        with Producer(
            servers[0].target, replica_id="vllm-0", model_id="llama", tenant_id="team-a", token=tokens["producer"]
        ) as producer:
            assert producer.report_token_chains([tokens_in], timeout=5).accepted
        deadline = time.monotonic() + 15
        with Router(servers[1].target, timeout=5) as router:
            while True:
                result = router.lookup("llama", tenant_id="team-a", token_ids=tokens_in)
                if result.hit:
                    break
                assert time.monotonic() < deadline, f"no hit on the second server: {result}\n{servers[1].logs()}"
                time.sleep(0.1)
        assert [(s.replica_id, s.matched_tokens) for s in result.replica_scores] == [("vllm-0", 64)]
        while True:
            first, second = (digest(s, tokens["controller"]) for s in servers)
            head = max(first["stream_last_seq"], second["stream_last_seq"])
            if first["stream_seq"] == second["stream_seq"] == head and first["buffered_records"] == 0:
                break
            assert time.monotonic() < deadline, f"{first} vs {second}"
            time.sleep(0.1)
        assert first["digest"] == second["digest"] and first["entries"] == second["entries"] == 4
    finally:
        for process in [s.process for s in servers] + [nats]:
            stop(process)
