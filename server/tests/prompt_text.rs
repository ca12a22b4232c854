//! `prompt_text` lookups through an injected tokenizer double (server.md §7.2–§7.4; SV48–SV50,
//! the stalled-tokenizer fault).

mod common;

use common::{TestServer, lookup, manual_state, prompt_lookup, report_token_chain};
use inferencecache_server::policy::decode_push;
use inferencecache_server::state::ServerOptions;
use inferencecache_tokenize::{PromptTokenizer, TokenizeError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Returns fixed tokens and records what it was asked; optionally stalls.
#[derive(Default)]
struct Double {
    tokens: Vec<u32>,
    stall: Option<Duration>,
    calls: Mutex<Vec<(String, String)>>,
}

impl PromptTokenizer for Double {
    fn encode_chat(&self, model_id: &str, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        self.calls
            .lock()
            .unwrap()
            .push((model_id.to_string(), prompt.to_string()));
        if let Some(d) = self.stall {
            std::thread::sleep(d);
        }
        if model_id == "unknown" {
            return Err(TokenizeError::UnknownModel);
        }
        Ok(self.tokens.clone())
    }
}

async fn server_with(double: Arc<Double>) -> TestServer {
    let options = ServerOptions {
        tokenizer: Some(double),
        ..Default::default()
    };
    TestServer::start_with(manual_state(options).0).await
}

#[tokio::test]
async fn sv49_prompt_text_matches_with_echo() {
    let tokens: Vec<u32> = (500..564).collect();
    let double = Arc::new(Double {
        tokens: tokens.clone(),
        ..Default::default()
    });
    let server = server_with(double.clone()).await;
    let mut c = server.client().await;
    report_token_chain(&mut c, "r1", "m", &tokens, 16).await;
    let r = lookup(&mut c, prompt_lookup("m", "hello there")).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(r.replica_scores[0].matched_tokens, 64);
    assert_eq!(r.token_ids, tokens, "tokens are echoed");
    assert_eq!(
        double.calls.lock().unwrap().as_slice(),
        [("m".to_string(), "hello there".to_string())]
    );
    // An unknown model fails open without echo.
    let r = lookup(&mut c, prompt_lookup("unknown", "hello")).await;
    assert_eq!((r.reason_code.as_str(), r.token_ids.len()), ("NO_HINT", 0));
    server.shutdown().await;
}

#[tokio::test]
async fn sv50_sub_block_prompt_fails_open_with_echo() {
    let double = Arc::new(Double {
        tokens: vec![1, 2, 3],
        ..Default::default()
    });
    let server = server_with(double).await;
    let mut c = server.client().await;
    let r = lookup(&mut c, prompt_lookup("m", "hi")).await;
    assert_eq!(r.reason_code, "NO_HINT");
    assert_eq!(
        r.token_ids,
        [1, 2, 3],
        "a sub-block prompt fails open with echo"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn stalled_tokenizer_times_out_within_the_deadline() {
    let double = Arc::new(Double {
        tokens: (0..32).collect(),
        stall: Some(Duration::from_millis(400)),
        ..Default::default()
    });
    let server = server_with(double).await;
    server.state.policies().replace_pushed(
        decode_push(br#"{"version":7,"policies":[{"namespace":"t","lookupTimeoutMs":20}]}"#)
            .unwrap(),
    );
    let mut c = server.client().await;
    let started = Instant::now();
    let r = lookup(&mut c, prompt_lookup("m", "slow")).await;
    assert_eq!(r.reason_code, "TIMEOUT");
    assert!(r.token_ids.is_empty());
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "answered at the deadline, not after the work"
    );
    assert!(r.lookup_latency_us >= 20_000);
    server.shutdown().await;
}

#[tokio::test]
async fn sv48_oversized_prompt_and_missing_tokenizer_fail_open() {
    let double = Arc::new(Double {
        tokens: (0..32).collect(),
        ..Default::default()
    });
    let server = server_with(double.clone()).await;
    let mut c = server.client().await;
    let big = "x".repeat((1 << 20) + 1);
    let r = lookup(&mut c, prompt_lookup("m", &big)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    assert!(double.calls.lock().unwrap().is_empty(), "never tokenized");
    server.shutdown().await;

    let server = TestServer::start().await;
    let mut c = server.client().await;
    let r = lookup(&mut c, prompt_lookup("m", "no tokenizer configured")).await;
    assert_eq!((r.reason_code.as_str(), r.token_ids.len()), ("NO_HINT", 0));
    server.shutdown().await;
}

#[tokio::test]
async fn require_chain_refuses_prompt_text_before_tokenizing() {
    let double = Arc::new(Double {
        tokens: (0..32).collect(),
        ..Default::default()
    });
    let server = server_with(double.clone()).await;
    server.state.policies().replace_pushed(
        decode_push(
            br#"{"version":7,"policies":[{"namespace":"t","strategy":{"requireChain":true}}]}"#,
        )
        .unwrap(),
    );
    let mut c = server.client().await;
    let r = lookup(&mut c, prompt_lookup("m", "hello")).await;
    assert_eq!(r.reason_code, "POLICY_REQUIRES_CHAIN");
    assert!(double.calls.lock().unwrap().is_empty());
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_tokenizer_fails_open_without_waiting() {
    let double = Arc::new(Double {
        tokens: (0..32).collect(),
        stall: Some(Duration::from_millis(600)),
        ..Default::default()
    });
    let server = server_with(double.clone()).await;
    let mut busy = Vec::new();
    for _ in 0..64 {
        let mut c = server.client().await;
        busy.push(tokio::spawn(async move {
            lookup(&mut c, prompt_lookup("m", "slow")).await
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while double.calls.lock().unwrap().len() < 64 {
        assert!(Instant::now() < deadline, "64 tokenizations in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut c = server.client().await;
    let started = Instant::now();
    let r = lookup(&mut c, prompt_lookup("m", "one too many")).await;
    assert_eq!((r.reason_code.as_str(), r.token_ids.len()), ("NO_HINT", 0));
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "did not wait for a slot"
    );
    for b in busy {
        let r = b.await.unwrap();
        assert_eq!(r.token_ids.len(), 32);
    }
    server.shutdown().await;
}
