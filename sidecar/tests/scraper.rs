//! Metrics scraper and stats reporter (spec `sidecar.md` §8–§9): SC09–SC12.

mod common;

use common::{Mode, sink_to, start_fake_server};
use inferencecache_sidecar::metrics::{
    CacheTierSel, Deriver, Profile, ScraperConfig, parse_exposition,
};
use inferencecache_sidecar::reporter::Identity;
use inferencecache_sidecar::scrape_client::{MAX_RESPONSE_BYTES, MetricsClient};
use inferencecache_sidecar::stats::{StaleLog, Staleness, StatsReporter};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn fixture(name: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(p).unwrap()
}

fn cfg(profile: Profile) -> ScraperConfig {
    ScraperConfig {
        profile,
        tier: CacheTierSel::Auto,
        model_name: String::new(),
        capacity_bytes: 1_000_000,
        ceiling: 256,
    }
}

fn close(a: f32, b: f64) -> bool {
    (f64::from(a) - b).abs() < 1e-6
}

#[test]
fn sc09_vllm_hit_rate_deltas() {
    let mut d = Deriver::new(cfg(Profile::Vllm));
    let s1 = d
        .derive(&parse_exposition(&fixture("vllm_tick1.prom")))
        .unwrap();
    assert_eq!(s1.hit_rate, 0.0, "first sample only sets the baseline");
    assert_eq!(d.baseline(), Some((25.0, 100.0)));
    assert!(close(s1.pressure, 4.0 / 256.0));
    assert_eq!(s1.cache_memory_bytes, 250_000);
    assert_eq!(s1.t2_hit_tokens, 40);
    assert_eq!(s1.t2_query_tokens, 160);
    let s2 = d
        .derive(&parse_exposition(&fixture("vllm_tick2.prom")))
        .unwrap();
    assert!(close(s2.hit_rate, 0.7), "{}", s2.hit_rate);
}

#[test]
fn sc09_counter_reset_rebases_then_fresh_delta() {
    let mut d = Deriver::new(cfg(Profile::Vllm));
    d.derive(&parse_exposition(&fixture("vllm_tick1.prom")))
        .unwrap();
    d.derive(&parse_exposition(&fixture("vllm_tick2.prom")))
        .unwrap();
    let r = d
        .derive(&parse_exposition(&fixture("vllm_reset.prom")))
        .unwrap();
    assert_eq!(r.hit_rate, 0.0, "counter reset → 0");
    assert_eq!(d.baseline(), Some((10.0, 20.0)), "baseline rebased");
    let a = d
        .derive(&parse_exposition(&fixture("vllm_after_reset.prom")))
        .unwrap();
    assert!(
        close(a.hit_rate, 0.5),
        "fresh delta 10/20, got {}",
        a.hit_rate
    );
    // Δqueries = 0 → 0, rebased.
    let z = d
        .derive(&parse_exposition(&fixture("vllm_after_reset.prom")))
        .unwrap();
    assert_eq!(z.hit_rate, 0.0);
}

#[test]
fn sc09_missing_counters_keep_the_baseline() {
    let mut d = Deriver::new(cfg(Profile::Vllm));
    d.derive(&parse_exposition(&fixture("vllm_tick1.prom")))
        .unwrap();
    let m = d
        .derive(&parse_exposition(&fixture("vllm_no_hits.prom")))
        .unwrap();
    assert_eq!(m.hit_rate, 0.0);
    assert_eq!(d.baseline(), Some((25.0, 100.0)));
    assert_eq!(m.t2_hit_tokens, 0, "absent T2 counter → 0");
    let s2 = d
        .derive(&parse_exposition(&fixture("vllm_tick2.prom")))
        .unwrap();
    assert!(close(s2.hit_rate, 0.7));
}

#[test]
fn vllm_legacy_usage_gauges_untyped_counters_and_tiers() {
    let exp = parse_exposition(&fixture("vllm_legacy.prom"));
    // auto: no kv gauge → max(gpu, cpu).
    let s = Deriver::new(cfg(Profile::Vllm)).derive(&exp).unwrap();
    assert_eq!(s.cache_memory_bytes, 600_000);
    for (tier, want) in [
        (CacheTierSel::Gpu, 400_000),
        (CacheTierSel::Cpu, 600_000),
        (CacheTierSel::Kv, 0),
    ] {
        let mut c = cfg(Profile::Vllm);
        c.tier = tier;
        assert_eq!(
            Deriver::new(c).derive(&exp).unwrap().cache_memory_bytes,
            want
        );
    }
    // Counters without `_total` are found as `<name>`.
    let mut d = Deriver::new(cfg(Profile::Vllm));
    d.derive(&exp).unwrap();
    assert_eq!(d.baseline(), Some((5.0, 10.0)));
    // Capacity 0 → memory 0; ceiling ≤ 0 → pressure 0.
    let mut c = cfg(Profile::Vllm);
    c.capacity_bytes = 0;
    c.ceiling = 0;
    let s = Deriver::new(c).derive(&exp).unwrap();
    assert_eq!(s.cache_memory_bytes, 0);
    assert_eq!(s.pressure, 0.0);
    // Pressure clamps at 1.
    let mut c = cfg(Profile::Vllm);
    c.ceiling = 1;
    assert_eq!(Deriver::new(c).derive(&exp).unwrap().pressure, 1.0);
}

#[test]
fn gauges_typed_as_counters_do_not_count() {
    let text = "# TYPE vllm:num_requests_running counter\nvllm:num_requests_running 1\n\
                # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1\n";
    assert!(
        Deriver::new(cfg(Profile::Vllm))
            .derive(&parse_exposition(text))
            .is_err()
    );
}

#[test]
fn sc10_sglang_dp_ranks_and_priority_breakdowns() {
    let mut c = cfg(Profile::Sglang);
    c.capacity_bytes = 1_000;
    let s = Deriver::new(c)
        .derive(&parse_exposition(&fixture("sglang.prom")))
        .unwrap();
    assert!(
        close(s.pressure, (3.0 + 5.0 + 1.0 + 2.0) / 256.0),
        "{}",
        s.pressure
    );
    assert!(close(s.hit_rate, 0.90));
    assert_eq!(s.cache_memory_bytes, 700);
    assert_eq!(s.t2_hit_tokens, 0);
    assert_eq!(s.t2_query_tokens, 0);
    // Model filter keeps matching series.
    let mut c = cfg(Profile::Sglang);
    c.model_name = "qwen".into();
    assert!(
        Deriver::new(c)
            .derive(&parse_exposition(&fixture("sglang.prom")))
            .is_ok()
    );
}

#[test]
fn sc11_scrape_errors_leave_the_baseline_untouched() {
    let mut d = Deriver::new(cfg(Profile::Vllm));
    d.derive(&parse_exposition(&fixture("vllm_tick1.prom")))
        .unwrap();
    let base = d.baseline();
    // SGLang metrics under the vLLM profile: no recognized family.
    let e = d
        .derive(&parse_exposition(&fixture("sglang.prom")))
        .unwrap_err();
    assert!(e.0.contains("no recognized metric families"), "{e}");
    // Only `running` present (counters present and changed: must not move the baseline).
    let only_running: String = fixture("vllm_tick2.prom")
        .lines()
        .filter(|l| !l.contains("num_requests_waiting"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(d.derive(&parse_exposition(&only_running)).is_err());
    // Model filter excluding the load gauges.
    let mut c = cfg(Profile::Vllm);
    c.model_name = "other-model".into();
    let mut filtered = Deriver::new(c);
    assert!(
        filtered
            .derive(&parse_exposition(&fixture("vllm_tick1.prom")))
            .is_err()
    );
    assert_eq!(filtered.baseline(), None);
    // NaN-only load gauges.
    let mut sg = Deriver::new(cfg(Profile::Sglang));
    assert!(
        sg.derive(&parse_exposition(&fixture("sglang_nan.prom")))
            .is_err()
    );
    // Empty exposition.
    assert!(d.derive(&parse_exposition("")).is_err());
    assert_eq!(d.baseline(), base, "baseline untouched by failed scrapes");
}

/// A tiny HTTP server answering each GET with the current (status, body).
async fn metrics_server(state: Arc<Mutex<(u16, String)>>) -> String {
    serve(state, None).await
}

/// The same over TLS with a certificate for 127.0.0.1 from `ca`.
async fn https_metrics_server(
    state: Arc<Mutex<(u16, String)>>,
    ca: &inferencecache_test_ca::Ca,
) -> String {
    use rustls_pki_types::pem::PemObject;
    let (cert, key) = ca.leaf();
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let url = serve(
        state,
        Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
    )
    .await;
    url.replacen("http://", "https://", 1)
}

async fn serve(state: Arc<Mutex<(u16, String)>>, tls: Option<tokio_rustls::TlsAcceptor>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = l.accept().await else {
                return;
            };
            let state = state.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(sock).await {
                            answer(stream, state).await;
                        }
                    }
                    None => answer(sock, state).await,
                }
            });
        }
    });
    format!("http://{addr}/metrics")
}

async fn answer<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut sock: S,
    state: Arc<Mutex<(u16, String)>>,
) {
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match sock.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let (code, body) = state.lock().unwrap().clone();
    let resp = format!(
        "HTTP/1.1 {code} X\r\nContent-Type: text/plain; version=0.0.4\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = sock.write_all(resp.as_bytes()).await;
    let _ = sock.shutdown().await;
}

#[tokio::test]
async fn http_get_reads_body_and_rejects_non_200() {
    let client = MetricsClient::new();
    let state = Arc::new(Mutex::new((200u16, "hello".to_string())));
    let url = metrics_server(state.clone()).await;
    assert_eq!(client.get(&url).await.unwrap(), "hello");
    state.lock().unwrap().0 = 503;
    let err = client.get(&url).await.unwrap_err();
    assert!(err.0.contains("status 503"), "{err}");
    assert!(client.get("http://127.0.0.1:1/metrics").await.is_err());
    assert!(client.get("ftp://127.0.0.1/metrics").await.is_err());
    assert!(client.get("not a url").await.is_err());
}

#[tokio::test]
async fn https_is_verified_against_the_trusted_cas() {
    let ca = inferencecache_test_ca::Ca::new("metrics-ca");
    let state = Arc::new(Mutex::new((200u16, "secure".to_string())));
    let url = https_metrics_server(state, &ca).await;
    let trusting = MetricsClient::with_extra_ca(ca.pem().as_bytes()).unwrap();
    assert_eq!(trusting.get(&url).await.unwrap(), "secure");
    // Without the CA the certificate is not trusted.
    assert!(MetricsClient::new().get(&url).await.is_err());
    assert!(MetricsClient::with_extra_ca(b"no pem here").is_err());
}

#[tokio::test]
async fn oversized_bodies_are_rejected() {
    let client = MetricsClient::new();
    let state = Arc::new(Mutex::new((200u16, "x".repeat(MAX_RESPONSE_BYTES + 1))));
    let url = metrics_server(state.clone()).await;
    let err = client.get(&url).await.unwrap_err();
    assert!(err.0.contains("body"), "{err}");
    state.lock().unwrap().1 = "x".repeat(MAX_RESPONSE_BYTES);
    assert_eq!(client.get(&url).await.unwrap().len(), MAX_RESPONSE_BYTES);
}

#[tokio::test]
async fn sc12_staleness_sequence_and_ack_rejection() {
    let state = Arc::new(Mutex::new((200u16, fixture("vllm_tick1.prom"))));
    let url = metrics_server(state.clone()).await;
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut sr = StatsReporter {
        identity: Identity {
            replica_id: "r0".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
        },
        url,
        client: MetricsClient::new(),
        interval: std::time::Duration::from_secs(10),
        deriver: Deriver::new(cfg(Profile::Vllm)),
        endpoint: "10.0.0.7:8000".into(),
        sink: sink_to(addr, None),
        staleness: Staleness::new(),
    };
    // Tick 1: success.
    assert_eq!(sr.tick_and_log().await, StaleLog::Quiet);
    let u = rec.updates().pop().unwrap();
    assert!(u.prefixes.is_empty());
    assert_eq!(u.hash_scheme, "vllm");
    assert!(u.timestamp_us > 0);
    let st = u.stats.unwrap();
    assert_eq!(st.replica_id, "r0");
    assert_eq!(st.cache_memory_bytes, 250_000);
    // The engine's API address rides with the stats (the server's endpoint picker).
    assert_eq!(st.endpoint, "10.0.0.7:8000");
    // Ticks 2–6 fail: scrape errors, then Ack.accepted = false, then RPC errors.
    state.lock().unwrap().0 = 500;
    let mut logs = vec![sr.tick_and_log().await, sr.tick_and_log().await];
    state.lock().unwrap().0 = 200;
    rec.set_mode(Mode::Reject);
    logs.push(sr.tick_and_log().await);
    rec.set_mode(Mode::Fail);
    logs.push(sr.tick_and_log().await);
    logs.push(sr.tick_and_log().await);
    let warns = logs
        .iter()
        .filter(|l| matches!(l, StaleLog::Warn { .. }))
        .count();
    let errors: Vec<_> = logs
        .iter()
        .filter(|l| matches!(l, StaleLog::Stale { .. }))
        .collect();
    let debugs = logs
        .iter()
        .filter(|l| matches!(l, StaleLog::Debug { .. }))
        .count();
    assert_eq!((warns, errors.len(), debugs), (2, 1, 2), "{logs:?}");
    assert_eq!(
        errors[0],
        &StaleLog::Stale {
            consecutive: 3,
            never_delivered: false
        }
    );
    rec.set_mode(Mode::Ok);
    assert_eq!(
        sr.tick_and_log().await,
        StaleLog::Recovered { after_failures: 5 }
    );
    assert_eq!(sr.tick_and_log().await, StaleLog::Quiet);
}

#[tokio::test]
async fn stale_wording_when_never_delivered() {
    let (_rec, addr) = start_fake_server(Mode::Ok).await;
    let mut sr = StatsReporter {
        identity: Identity::default(),
        url: "http://127.0.0.1:1/metrics".into(),
        client: MetricsClient::new(),
        interval: std::time::Duration::from_secs(10),
        deriver: Deriver::new(cfg(Profile::Vllm)),
        endpoint: "10.0.0.7:8000".into(),
        sink: sink_to(addr, None),
        staleness: Staleness::new(),
    };
    sr.tick_and_log().await;
    sr.tick_and_log().await;
    assert_eq!(
        sr.tick_and_log().await,
        StaleLog::Stale {
            consecutive: 3,
            never_delivered: true
        }
    );
}
