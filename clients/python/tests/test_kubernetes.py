"""``deploy/kubernetes/`` manifests: valid against the Kubernetes schemas (offline, strict), and
every argument they give the server and the sidecar is accepted by the real binaries.

No Secret is committed: ``create-secrets.sh`` generates them, and the tests mount its output.
The server StatefulSet runs with its own arguments, ConfigMap, Secret and state volume (mounted
paths mapped to temporary directories, bind addresses moved to free loopback ports); its gRPC
health check must be SERVING, its liveness path must answer, its control listener must refuse a
request without the controller token, and after a restart on the same volume it must answer
from the index it had (the StatefulSet keeps the index across rollouts). The vLLM
pod's sidecar then runs with its own arguments (the downward-API variables expanded as the
kubelet would, the engine replaced by the fake engine) and a lookup must find the fake engine's
blocks under the pod's name and namespace. The replicated manifest's NATS and two of its servers
run with their own arguments too, and must converge.
"""

from __future__ import annotations

import json
import pathlib
import re
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

KUBERNETES = REPO / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))
KUBERNETES_VERSION = "1.33.0"
POD_NAME, POD_NAMESPACE = "vllm-llama-7d9f-x2k4q", "team-a"
# Prometheus Operator objects: no schema in kubernetes-validate (a CRD), checked by structure.
OPERATOR_API = "monitoring.coreos.com/v1"
# The label the control listener's NetworkPolicy admits (documented in server.yaml).
CONTROL_CLIENT_LABEL = {"inferencecache.io/control-client": "true"}


def documents() -> List[dict]:
    docs = []
    for path in MANIFESTS:
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


_SECRETS: List[dict] = []


def generated_secrets() -> List[dict]:
    """The Secrets ``create-secrets.sh`` prints (generated once per session)."""
    if not _SECRETS:
        out = subprocess.run(["bash", str(KUBERNETES / "create-secrets.sh")], check=True, capture_output=True, text=True).stdout
        _SECRETS.extend(d for d in yaml.safe_load_all(out) if d)
    return _SECRETS


def find(kind: str, name: str) -> dict:
    pool = documents() + (generated_secrets() if kind == "Secret" else [])
    matches = [d for d in pool if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}"
    return matches[0]


def container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def workloads() -> List[dict]:
    return [d for d in documents() if d["kind"] in ("Deployment", "StatefulSet")]


def selects(selector: dict, labels: Dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def test_manifests_exist():
    assert {p.name for p in MANIFESTS} >= {"server.yaml", "vllm-with-sidecar.yaml", "replicated.yaml", "monitoring.yaml"}


@pytest.mark.parametrize(
    "doc",
    [d for d in documents() + generated_secrets() if d["apiVersion"] != OPERATOR_API],
    ids=lambda d: f'{d["kind"]}/{d["metadata"]["name"]}',
)
def test_schema_valid_strict(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_no_secret_is_committed_and_generated_tokens_are_fresh():
    assert [d for d in documents() if d["kind"] == "Secret"] == [], "Secrets come from create-secrets.sh"
    first = generated_secrets()
    second = [d for d in yaml.safe_load_all(subprocess.run(["bash", str(KUBERNETES / "create-secrets.sh")], check=True, capture_output=True, text=True).stdout) if d]
    tokens = [v for d in first for v in d["stringData"].values()]
    again = [v for d in second for v in d["stringData"].values()]
    assert len(tokens) == 4 and all(len(t) == 64 and int(t, 16) >= 0 for t in tokens)
    assert len(set(tokens)) == 4 and not set(tokens) & set(again)
    # Every Secret a workload mounts or reads is one the script makes.
    made = {d["metadata"]["name"]: set(d["stringData"]) for d in first}
    for workload in workloads():
        spec = workload["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                assert name in made, name
                assert {i["key"] for i in volume["secret"].get("items", [])} <= made[name]
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in made.get(ref["name"], set()), ref


def test_server_keeps_its_index_and_liveness_is_not_readiness():
    for kind, name in (("StatefulSet", "inferencecache"), ("Deployment", "inferencecache-replicated")):
        server = container(find(kind, name), "server")
        assert server["readinessProbe"]["grpc"]["port"] == 9090, name
        assert server["startupProbe"]["grpc"]["port"] == 9090, name
        # Liveness must not follow readiness (NOT_SERVING while restoring or re-bootstrapping).
        assert server["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}, name
        assert "grpc" not in server["livenessProbe"], name
    statefulset = find("StatefulSet", "inferencecache")
    server = container(statefulset, "server")
    (state_dir,) = [a.split("=", 1)[1] for a in server["args"] if a.startswith("--state-dir=")]
    (mount,) = [m for m in server["volumeMounts"] if m["mountPath"] == state_dir]
    assert not mount.get("readOnly")
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims, "the state directory is a persistent volume"
    assert statefulset["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 65532
    assert find("Service", statefulset["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_server_control_is_internal_and_policies_match_real_pods():
    public = find("Service", "inferencecache")
    assert sorted(p["port"] for p in public["spec"]["ports"]) == [8080, 9090], "no control port on the public Service"
    policy = find("NetworkPolicy", "inferencecache-control-internal")
    control_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == 8081 for p in r["ports"])]
    assert control_rules and all(r.get("from") for r in control_rules), "8081 only from selected pods"
    for rule in control_rules:
        for peer in rule["from"]:
            assert peer["podSelector"]["matchLabels"] == CONTROL_CLIENT_LABEL
    server = container(find("StatefulSet", "inferencecache"), "server")
    assert "--controller-token-file=/etc/inferencecache/tokens/controller" in server["args"]
    # Every policy applies to pods the manifests run, and the control policy to every index
    # server (single and replicated); every admitted peer is a pod the manifests run, or the
    # documented control-client label.
    templates = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads()}
    for doc in documents():
        if doc["kind"] != "NetworkPolicy":
            continue
        selected = {n for n, labels in templates.items() if selects(doc["spec"]["podSelector"], labels)}
        assert selected, f'{doc["metadata"]["name"]} selects no pod'
        if doc["metadata"]["name"] == "inferencecache-control-internal":
            assert selected == {"inferencecache", "inferencecache-replicated"}
        for rule in doc["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                labels = peer["podSelector"]["matchLabels"]
                assert labels == CONTROL_CLIENT_LABEL or any(selects(peer["podSelector"], t) for t in templates.values()), labels


def test_monitors_select_the_real_services_and_pods():
    monitor = find("ServiceMonitor", "inferencecache")
    selected = [
        d["metadata"]["name"]
        for d in documents()
        if d["kind"] == "Service" and selects(monitor["spec"]["selector"], d["metadata"].get("labels", {}))
    ]
    assert sorted(selected) == ["inferencecache", "inferencecache-replicated"]
    for name in selected:
        ports = {p["name"] for p in find("Service", name)["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    pods = find("PodMonitor", "inferencecache-sidecar")
    (engine_pod,) = [w for w in workloads() if selects(pods["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
    sidecar = container(engine_pod, "inferencecache-sidecar")
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    (port,) = [p for p in sidecar["ports"] if p["name"] == endpoint["port"]]
    bind = next(a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--metrics-bind-address="))
    assert bind == f"0.0.0.0:{port['containerPort']}", "the sidecar's metrics listen on the pod IP"
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "sidecar-metrics"}


def test_engine_pod_runs_the_tested_vllm_with_a_replay_socket():
    pod = find("Deployment", "vllm-llama")
    vllm = container(pod, "vllm")
    prepare = (REPO / "sidecar" / "tests" / "engines" / "prepare.sh").read_text()
    tested = re.search(r'vllm_version="\$\{VLLM_VERSION:-([0-9.]+)\}"', prepare).group(1)
    assert vllm["image"] == f"vllm/vllm-openai:v{tested}"
    config = json.loads(next(a.split("=", 1)[1] for a in vllm["args"] if a.startswith("--kv-events-config=")))
    sidecar = container(pod, "inferencecache-sidecar")
    replay = next(a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--engine-replay-endpoint="))
    assert config["replay_endpoint"].rsplit(":", 1)[1] == replay.rsplit(":", 1)[1]
    assert config["buffer_steps"] > 0
    topic = next(a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--topic="))
    assert config["topic"] == topic


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
    claims = {c["metadata"]["name"] for c in deployment["spec"].get("volumeClaimTemplates", [])}
    mapping: Dict[str, pathlib.Path] = {}
    for mount in container(deployment, name).get("volumeMounts", []):
        local = root / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        if mount["name"] in claims:
            # A persistent volume: an empty directory that outlives the process.
            mapping[mount["mountPath"]] = local
            continue
        volume = volumes[mount["name"]]
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


def run_server(args: List[str], ports, log: pathlib.Path) -> Server:
    process = subprocess.Popen([str(server_bin()), *args], stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    return Server(process, *ports, log)


def test_manifest_arguments_run_on_the_real_binaries(tmp_path):
    deployment = find("StatefulSet", "inferencecache")
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
    server = run_server(args, (grpc_port, http_port, control_port), log)
    process = server.process
    engine = sidecar = None
    try:
        wait_ready(server)
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        liveness = container(deployment, "server")["livenessProbe"]["httpGet"]["path"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{liveness}", timeout=5) as reply:
            assert reply.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{server.control_url}/snapshot", timeout=5)
        assert refused.value.code == 401
        tokens = find("Secret", "inferencecache-tokens")["stringData"]
        request = urllib.request.Request(f"{server.control_url}/snapshot", headers={"Authorization": f"Bearer {tokens['controller']}"})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.status == 200

        # A rollout: SIGTERM writes the final checkpoint to the state volume, the next pod on
        # the same volume answers from it.
        kept = [1000 + i for i in range(64)]
        with Producer(server.target, replica_id="vllm-kept", model_id="llama", tenant_id="team-a", token=tokens["producer"]) as producer:
            assert producer.report_token_chains([kept], timeout=5).accepted
        stop(process)
        assert process.returncode == 0, server.logs()
        server = run_server(args, (grpc_port, http_port, control_port), log)
        process = server.process
        wait_ready(server)
        with Router(server.target, timeout=5) as router:
            result = router.lookup("llama", tenant_id="team-a", token_ids=kept)
        assert [(s.replica_id, s.matched_tokens) for s in result.replica_scores] == [("vllm-kept", 64)], server.logs()

        # The sidecar with the vLLM pod's arguments, next to a fake engine on the same topic.
        pod = find("Deployment", "vllm-llama")
        spec = container(pod, "inferencecache-sidecar")
        engine_port, sidecar_metrics_port = free_port(), free_port()
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
                    # The fake engine has no replay socket: a closed port (gaps go unfilled).
                    "--engine-replay-endpoint": f"tcp://127.0.0.1:{free_port()}",
                    "--engine-metrics-url": f"http://127.0.0.1:{free_port()}/metrics",
                    "--metrics-bind-address": f"127.0.0.1:{sidecar_metrics_port}",
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
        # The sidecar's liveness path and metrics, on the port the PodMonitor scrapes.
        probe = spec["livenessProbe"]["httpGet"]["path"]
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{sidecar_metrics_port}{probe}", timeout=5) as reply:
                    assert reply.status == 200
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, sidecar_log.read_text()
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{sidecar_metrics_port}/metrics", timeout=5) as reply:
            assert "inferencecache_sidecar_updates_sent_total" in reply.read().decode()
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
