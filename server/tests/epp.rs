//! The endpoint picker's ext_proc protocol against the real binary, with this test playing
//! Envoy's side (docs/epp.md): the pick from a cached prefix, the answer as header and
//! metadata, the body returned unchanged, the subset hint, and every bad input's documented
//! outcome (400, 503, pick by load) without a hang.

mod common;
mod epp_support;

use common::{ServerProcess, free_port, http_request, temp_dir};
use epp_support::*;
use inferencecache_proto::v1alpha1 as pb;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

const ENDPOINT_A: &str = "10.0.0.1:8000";
const ENDPOINT_B: &str = "10.0.0.2:8000";
const ENDPOINT_OTHER: &str = "10.0.0.3:8000";

struct Picker {
    server: ServerProcess,
    addr: SocketAddr,
}

async fn start(name: &str) -> Picker {
    start_with(name, &[]).await
}

/// A picker server in `dir` with `flags`, ready and listening.
async fn listening_picker(dir: &Path, models: &Path, flags: &[&str]) -> Picker {
    let (server, addr) = picker_server(dir, models, flags);
    server.wait_ready().await;
    let started = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "picker not listening: {}",
            server.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Picker { server, addr }
}

async fn start_with(name: &str, extra: &[&str]) -> Picker {
    let dir = temp_dir(name);
    let models = models_dir(&dir);
    let flags = [&["--epp-max-body-bytes", "65536"], extra].concat();
    let picker = listening_picker(&dir, &models, &flags).await;
    let mut client = picker.server.client().await;
    // Replicas a and b serve MODEL; "other" serves a model the tokenizer does not know.
    let mut updates = Vec::new();
    for (replica, model, endpoint) in [
        ("ra", MODEL, ENDPOINT_A),
        ("rb", MODEL, ENDPOINT_B),
        ("rother", "other/model", ENDPOINT_OTHER),
    ] {
        updates.push(pb::CacheStateUpdate {
            replica_id: replica.into(),
            model_id: model.into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            stats: Some(pb::ReplicaStats {
                endpoint: endpoint.into(),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    common::report(&mut client, updates).await;
    picker
}

/// Reports `tokens`' block chain for `replica` (tenant `t`, MODEL).
async fn cache(picker: &Picker, replica: &str, tokens: &[u32]) {
    let mut client = picker.server.client().await;
    common::report_token_chain(&mut client, replica, MODEL, tokens, 16).await;
}

async fn metric(picker: &Picker, sample: &str) -> f64 {
    let addr = SocketAddr::from(([127, 0, 0, 1], picker.server.http));
    let (_, _, text) = http_request(addr, "GET", "/metrics", "").await;
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{sample} not in /metrics"))
}

#[tokio::test]
async fn cached_prefix_is_picked_and_the_body_comes_back_unchanged() {
    let picker = start("epp-prefix").await;
    let system = words(100, 120);
    let first = [("system", system.as_str()), ("user", "w7 w8 w9")];
    // The engine behind `rb` served the first turn and cached it.
    cache(&picker, "rb", &chat_tokens(&first)).await;
    let follow_up = [
        ("system", system.as_str()),
        ("user", "w7 w8 w9"),
        ("assistant", "w1 w2"),
        ("user", "w3 w4"),
    ];
    let body = chat_body(&follow_up, false);
    // Small chunks: the picker reassembles the body before parsing it.
    let answer =
        ext_proc_request(picker.addr, "/v1/chat/completions", &[], body.as_bytes(), 7).await;
    assert_eq!(answer.endpoints(), [ENDPOINT_B, ENDPOINT_A], "{answer:?}");
    assert_eq!(
        answer.metadata, answer.header,
        "header and envoy.lb metadata agree"
    );
    assert_eq!(
        answer.body,
        body.as_bytes(),
        "the body is returned unchanged"
    );
    assert_eq!(
        metric(&picker, "inferencecache_epp_picks_total{reason=\"prefix\"}").await,
        1.0
    );
    // A conversation nobody cached goes by load (both idle: either, but both listed).
    let other = chat_body(&[("user", &words(3000, 90))], false);
    let answer = chat_completion(picker.addr, &other).await;
    let mut listed = answer.endpoints();
    listed.sort();
    assert_eq!(listed, [ENDPOINT_A, ENDPOINT_B]);
    assert_eq!(
        metric(&picker, "inferencecache_epp_picks_total{reason=\"load\"}").await,
        1.0
    );
    // The subset hint (here as the request header) restricts the list, cache or not.
    let answer = ext_proc_request(
        picker.addr,
        "/v1/chat/completions",
        &[("x-gateway-destination-endpoint-subset", ENDPOINT_A)],
        body.as_bytes(),
        4096,
    )
    .await;
    assert_eq!(answer.endpoints(), [ENDPOINT_A]);
    // A completion prompt is tokenized raw: its own cached prefix is found too.
    let prompt = words(5000, 100);
    let tokens: Vec<u32> = (5000..5100).map(|k| WORD_BASE + k).collect();
    cache(&picker, "ra", &tokens).await;
    let completion =
        serde_json::json!({ "model": MODEL, "prompt": format!("{prompt} w1") }).to_string();
    let answer = ext_proc_request(
        picker.addr,
        "/v1/completions",
        &[],
        completion.as_bytes(),
        4096,
    )
    .await;
    assert_eq!(answer.endpoints()[0], ENDPOINT_A);
}

/// The tokenizer's segment cache (docs/epp.md): a repeated system prompt is encoded once, the
/// picks are the same with the cache off, and its counters say exactly what it did.
#[tokio::test]
async fn a_repeated_system_prompt_is_encoded_once() {
    let system = words(100, 120);
    let questions = ["w7 w8 w9", "w10 w11", "w12"];
    let mut picks = Vec::new();
    for (name, extra) in [
        ("epp-segments", &[][..]),
        (
            "epp-segments-off",
            &["--tokenizer-segment-cache-bytes", "0"][..],
        ),
    ] {
        let picker = start_with(name, extra).await;
        cache(&picker, "rb", &chat_tokens(&[("system", system.as_str())])).await;
        let mut endpoints = Vec::new();
        for question in questions {
            let body = chat_body(&[("system", system.as_str()), ("user", question)], false);
            let answer = chat_completion(picker.addr, &body).await;
            endpoints.push(answer.endpoints());
        }
        let sample = |name: &str| format!("inferencecache_tokenizer_segment_cache_{name}");
        let counters = [
            metric(&picker, &sample("lookups_total{result=\"hit\"}")).await,
            metric(&picker, &sample("lookups_total{result=\"miss\"}")).await,
            metric(&picker, &sample("hit_tokens_total")).await,
            metric(&picker, &sample("capacity_bytes")).await,
        ];
        if extra.is_empty() {
            // ChatML pieces between the markers: "system\n…", "\n", "user\n…", "\n",
            // "assistant\n". The first request misses all but its second "\n"; the next two
            // miss only their question. Hit ids: "system" + 120 words + "assistant", twice.
            assert_eq!(counters, [9.0, 6.0, 244.0, 67_108_864.0], "{name}");
            let entries = metric(&picker, &sample("entries")).await;
            assert_eq!(entries, 6.0);
        } else {
            assert_eq!(counters, [0.0, 0.0, 0.0, 0.0], "{name}");
        }
        assert_eq!(
            metric(&picker, "inferencecache_epp_picks_total{reason=\"prefix\"}").await,
            3.0,
            "{name}"
        );
        picks.push(endpoints);
    }
    assert_eq!(
        picks[0], picks[1],
        "the same picks with and without the cache"
    );
    assert!(
        picks[0].iter().all(|e| e == &[ENDPOINT_B, ENDPOINT_A]),
        "{picks:?}"
    );
}

#[tokio::test]
async fn bad_input_has_its_documented_outcome() {
    let picker = start("epp-bad-input").await;
    let path = "/v1/chat/completions";
    // Not JSON: 400, answered directly.
    let answer = ext_proc_request(picker.addr, path, &[], b"{not json", 4096).await;
    assert_eq!(answer.immediate_status, 400);
    // Over --epp-max-body-bytes: routed by load, the body streams through unchanged.
    let huge = chat_body(&[("user", &"w1 ".repeat(40_000))], false);
    assert!(huge.len() > 65536);
    let answer = ext_proc_request(picker.addr, path, &[], huge.as_bytes(), 16 * 1024).await;
    assert!(!answer.endpoints().is_empty(), "{answer:?}");
    assert_eq!(answer.body.len(), huge.len());
    assert_eq!(answer.body, huge.as_bytes());
    // A model no endpoint serves: 503.
    let unknown = serde_json::json!({ "model": "nobody/serves", "messages": [{"role": "user", "content": "w1"}] });
    let answer =
        ext_proc_request(picker.addr, path, &[], unknown.to_string().as_bytes(), 4096).await;
    assert_eq!(answer.immediate_status, 503);
    // No messages: by load over the model's endpoints.
    let missing = serde_json::json!({ "model": MODEL });
    let answer =
        ext_proc_request(picker.addr, path, &[], missing.to_string().as_bytes(), 4096).await;
    let mut listed = answer.endpoints();
    listed.sort();
    assert_eq!(listed, [ENDPOINT_A, ENDPOINT_B]);
    // A model the tokenizer does not know (tokenizer failure): by load to its endpoint.
    let untokenizable = serde_json::json!({ "model": "other/model", "messages": [{"role": "user", "content": "w1"}] });
    let answer = ext_proc_request(
        picker.addr,
        path,
        &[],
        untokenizable.to_string().as_bytes(),
        4096,
    )
    .await;
    assert_eq!(answer.endpoints(), [ENDPOINT_OTHER]);
    // A request without a body: by load, at the headers.
    let answer = ext_proc_request(picker.addr, "/v1/models", &[], b"", 4096).await;
    assert!(!answer.endpoints().is_empty());
    for (reason, count) in [
        ("not_json", 1.0),
        ("too_large", 1.0),
        ("missing_prompt", 1.0),
        // The unknown model and the untokenizable one.
        ("tokenizer", 2.0),
    ] {
        let sample = format!("inferencecache_epp_body_parse_failures_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&picker, &sample).await, count, "{sample}");
    }
    assert_eq!(
        metric(
            &picker,
            "inferencecache_epp_picks_total{reason=\"bad_request\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &picker,
            "inferencecache_epp_picks_total{reason=\"no_endpoint\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_gateway_closing_the_stream_mid_body_costs_nothing() {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration, processing_request,
    };
    let picker = start("epp-closed").await;
    for _ in 0..3 {
        let mut client = ExternalProcessorClient::connect(format!("http://{}", picker.addr))
            .await
            .unwrap();
        let messages = vec![
            ProcessingRequest {
                protocol_config: Some(ProtocolConfiguration {
                    request_body_mode: 4, // FULL_DUPLEX_STREAMED
                    ..Default::default()
                }),
                request: Some(processing_request::Request::RequestHeaders(
                    HttpHeaders::default(),
                )),
                ..Default::default()
            },
            ProcessingRequest {
                request: Some(processing_request::Request::RequestBody(HttpBody {
                    body: b"{\"model\":\"org/chat\",\"mess".to_vec(),
                    end_of_stream: false,
                    ..Default::default()
                })),
                ..Default::default()
            },
        ];
        // The request stream ends (half-close) before the body does, then the client goes.
        let call = client.process(tokio_stream::iter(messages));
        let answered = tokio::time::timeout(Duration::from_secs(5), async {
            let mut responses = call.await.unwrap().into_inner();
            while let Ok(Some(_)) = responses.message().await {}
        })
        .await;
        assert!(answered.is_ok(), "the picker ended the stream within 5 s");
    }
    let sample = "inferencecache_epp_body_parse_failures_total{reason=\"stream_closed\"}";
    let started = Instant::now();
    while metric(&picker, sample).await < 3.0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "stream_closed not counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing was picked, and the picker still answers.
    assert_eq!(
        metric(&picker, "inferencecache_epp_endpoint_list_length_count").await,
        0.0
    );
    let body = chat_body(&[("user", "w1 w2")], false);
    let answer = chat_completion(picker.addr, &body).await;
    assert!(!answer.endpoints().is_empty());
}

#[tokio::test]
async fn health_services_answer() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let picker = start("epp-health").await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", picker.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service}");
    }
}

#[test]
fn a_bad_endpoints_file_or_picker_flag_exits_2() {
    let dir = temp_dir("epp-bad-flags");
    let file = dir.join("endpoints.json");
    std::fs::write(&file, r#"[{"replica_id":"r","endpoint":"not-an-address"}]"#).unwrap();
    let file = file.to_str().unwrap().to_owned();
    for extra in [
        vec!["--epp-endpoints-file", file.as_str()],
        vec!["--epp-load-weight", "-1"],
        vec!["--epp-max-endpoints", "0"],
    ] {
        let mut args = vec!["--epp-bind-address", "127.0.0.1:0"];
        args.extend(extra);
        let output = std::process::Command::new(common::SERVER_BIN)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
    }
}

#[tokio::test]
async fn shedding_answers_429_while_every_endpoint_is_at_the_limit() {
    let dir = temp_dir("epp-shed");
    let port = free_port();
    let bind = format!("127.0.0.1:{port}");
    let server = ServerProcess::start(
        &dir,
        &[
            "--epp-bind-address",
            &bind,
            "--epp-tenant",
            "t",
            "--epp-shed-in-flight",
            "1",
        ],
    );
    server.wait_ready().await;
    let addr: SocketAddr = bind.parse().unwrap();
    let mut client = server.client().await;
    let updates = [("ra", ENDPOINT_A), ("rb", ENDPOINT_B)]
        .iter()
        .map(|(replica, endpoint)| pb::CacheStateUpdate {
            replica_id: (*replica).into(),
            model_id: MODEL.into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            stats: Some(pb::ReplicaStats {
                endpoint: (*endpoint).into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    common::report(&mut client, updates).await;
    let body = chat_body(&[("user", "w1 w2")], false);
    let path = "/v1/chat/completions";
    // Two requests in flight, one per endpoint (the second goes to the idle one)...
    let (first, held_first) = ext_proc_open(addr, path, &[], body.as_bytes(), 4096).await;
    let (second, held_second) = ext_proc_open(addr, path, &[], body.as_bytes(), 4096).await;
    let mut picked = vec![first.endpoints()[0].clone(), second.endpoints()[0].clone()];
    picked.sort();
    assert_eq!(picked, [ENDPOINT_A, ENDPOINT_B]);
    // ...so the next one is shed.
    let third = ext_proc_request(addr, path, &[], body.as_bytes(), 4096).await;
    assert_eq!(third.immediate_status, 429);
    // One finishes: its endpoint takes the next request.
    let freed = first.endpoints()[0].clone();
    drop(held_first);
    let started = Instant::now();
    loop {
        let next = ext_proc_request(addr, path, &[], body.as_bytes(), 4096).await;
        if next.immediate_status == 0 {
            assert_eq!(next.endpoints()[0], freed);
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the in-flight unit was not released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(held_second);
}

/// Writes `text` to `path` the way a deployment should (a new file renamed over the old one,
/// as a Kubernetes ConfigMap mount does), so the reloader never reads half a file.
fn replace_file(path: &std::path::Path, text: &str) {
    let staged = path.with_extension("staged");
    std::fs::write(&staged, text).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

/// Asks for a chat pick until `accept` holds for its endpoint list (or 10 s pass: the file is
/// checked every 2 s).
async fn pick_until(
    addr: SocketAddr,
    body: &str,
    accept: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let started = Instant::now();
    loop {
        let answer = chat_completion(addr, body).await;
        let endpoints = answer.endpoints();
        if accept(&endpoints) {
            return endpoints;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the picker still answers {endpoints:?} ({answer:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_endpoints_file_reloads_without_a_restart_and_a_bad_one_keeps_the_last_good() {
    let dir = temp_dir("epp-endpoints-file");
    let models = models_dir(&dir);
    let file = dir.join("endpoints.json");
    replace_file(
        &file,
        &format!(r#"[{{"replica_id":"fa","endpoint":"{ENDPOINT_A}","models":["{MODEL}"]}}]"#),
    );
    let picker = listening_picker(
        &dir,
        &models,
        &["--epp-endpoints-file", file.to_str().unwrap()],
    )
    .await;
    let addr = picker.addr;
    let body = chat_body(&[("user", "w1 w2 w3")], false);
    // No sidecar reported anything: the file alone names the candidates.
    let first = pick_until(addr, &body, |_| true).await;
    assert_eq!(first, [ENDPOINT_A]);

    // The replica moves to a new address and a second one joins for MODEL; a third serves
    // another model only. The next picks use the new map, without a restart.
    replace_file(
        &file,
        &format!(
            r#"[{{"replica_id":"fa","endpoint":"{ENDPOINT_B}","models":["{MODEL}"]}},
                {{"replica_id":"fc","endpoint":"{ENDPOINT_OTHER}"}},
                {{"replica_id":"fx","endpoint":"10.0.0.9:8000","models":["other/model"]}}]"#
        ),
    );
    let mut reloaded = pick_until(addr, &body, |e| e.len() == 2).await;
    reloaded.sort();
    assert_eq!(reloaded, [ENDPOINT_B, ENDPOINT_OTHER]);
    let loaded = "inferencecache_epp_endpoints_file_reloads_total{outcome=\"loaded\"}";
    let failed = "inferencecache_epp_endpoints_file_reloads_total{outcome=\"failed\"}";
    assert_eq!(metric(&picker, loaded).await, 1.0);
    assert_eq!(metric(&picker, failed).await, 0.0);
    // The file's replica is a real candidate: its cached prefix wins the pick.
    let system = words(200, 120);
    let turn = [("system", system.as_str()), ("user", "w9")];
    cache(&picker, "fc", &chat_tokens(&turn)).await;
    let cached = chat_body(&turn, false);
    let answer = chat_completion(addr, &cached).await;
    assert_eq!(answer.endpoints(), [ENDPOINT_OTHER, ENDPOINT_B]);

    // A malformed file (and then one with an entry that is not ip:port) is refused, counted
    // and logged; the last good map stays in use.
    for bad in [
        "[{\"replica_id\":\"fa\",".to_owned(),
        format!(r#"[{{"replica_id":"fa","endpoint":"engine-0:8000","models":["{MODEL}"]}}]"#),
    ] {
        let before = metric(&picker, failed).await;
        replace_file(&file, &bad);
        let started = Instant::now();
        while metric(&picker, failed).await < before + 1.0 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the bad file was not counted"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut kept = pick_until(addr, &body, |_| true).await;
        kept.sort();
        assert_eq!(kept, [ENDPOINT_B, ENDPOINT_OTHER], "after {bad:?}");
    }
    assert_eq!(metric(&picker, failed).await, 2.0);
    assert_eq!(metric(&picker, loaded).await, 1.0);
    assert!(
        picker.server.logs().contains("epp_endpoints_reload_failed"),
        "the refusal is logged"
    );
    // Fixed again: picked up like any change.
    replace_file(
        &file,
        &format!(r#"[{{"replica_id":"fa","endpoint":"{ENDPOINT_A}"}}]"#),
    );
    pick_until(addr, &body, |e| e == [ENDPOINT_A]).await;
    assert_eq!(metric(&picker, loaded).await, 2.0);
}
