//! Shared pieces of the endpoint-picker tests (`epp.rs`, `epp_envoy.rs`): a word-level
//! tokenizer with a ChatML template in a models directory, small OpenAI-compatible fake engines
//! that record what they receive and stream tokens back, and an ext_proc client that plays
//! Envoy's side of protocol 004.

#![allow(dead_code)]

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request, processing_response,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, Tokenizer};

/// The model id the tests serve.
pub const MODEL: &str = "org/chat";
/// Token id of word `w0` (words `wK` have id `WORD_BASE + K`, so consecutive words are
/// consecutive ids: what the fake KV-event publisher stores).
pub const WORD_BASE: u32 = 6;
/// Words in the vocabulary.
pub const WORDS: u32 = 8192;
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The tokenizer of [`MODEL`].
pub fn tokenizer() -> Tokenizer {
    let mut vocab: Vec<(String, u32)> = [
        "[UNK]",
        "<|im_start|>",
        "<|im_end|>",
        "system",
        "user",
        "assistant",
    ]
    .iter()
    .enumerate()
    .map(|(i, w)| ((*w).to_owned(), i as u32))
    .collect();
    vocab.extend((0..WORDS).map(|k| (format!("w{k}"), WORD_BASE + k)));
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(WhitespaceSplit));
    tok.add_special_tokens([
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
    ])
    .unwrap();
    tok
}

/// A models directory holding [`MODEL`] (tokenizer plus ChatML template).
pub fn models_dir(root: &Path) -> PathBuf {
    let models = root.join("models");
    let dir = models.join("org").join("chat");
    std::fs::create_dir_all(&dir).unwrap();
    tokenizer().save(dir.join("tokenizer.json"), false).unwrap();
    let config = serde_json::json!({ "chat_template": CHATML, "eos_token": "<|im_end|>" });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    models
}

/// `count` words starting at word `first`, space separated.
pub fn words(first: u32, count: u32) -> String {
    (first..first + count)
        .map(|k| format!("w{}", k % WORDS))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The token ids an engine computes for a chat conversation (rendered independently of the
/// server: ChatML by hand, then encoded without special tokens).
pub fn chat_tokens(messages: &[(&str, &str)]) -> Vec<u32> {
    let mut rendered = String::new();
    for (role, content) in messages {
        rendered.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
    }
    rendered.push_str("<|im_start|>assistant\n");
    tokenizer()
        .encode(rendered, false)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// A chat request body.
pub fn chat_body(messages: &[(&str, &str)], stream: bool) -> String {
    let messages: Vec<serde_json::Value> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({ "role": role, "content": content }))
        .collect();
    serde_json::json!({ "model": MODEL, "messages": messages, "stream": stream }).to_string()
}

/// What a fake engine received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub body: String,
    /// The `x-gateway-destination-endpoint` header as it reached the engine.
    pub destination: Option<String>,
}

/// The chunks a fake engine streams for `stream: true` (SSE events, then `[DONE]`).
pub fn stream_chunks(engine: &str, tokens: usize) -> Vec<String> {
    let mut chunks: Vec<String> = (0..tokens)
        .map(|i| {
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{engine}-t{i} \"}}}}]}}\n\n"
            )
        })
        .collect();
    chunks.push("data: [DONE]\n\n".to_owned());
    chunks
}

/// Gap between streamed chunks.
pub const STREAM_GAP: Duration = Duration::from_millis(20);
/// Tokens a streamed answer carries.
pub const STREAM_TOKENS: usize = 10;

/// An OpenAI-compatible fake engine on loopback: records every request, answers
/// `/v1/chat/completions` and `/v1/completions` (streamed when asked, after the delay the
/// `x-test-delay-ms` request header names), and `/metrics` in vLLM's names (idle).
pub struct FakeEngine {
    pub name: String,
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct EngineState {
    name: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// The benchmark's engine: records nothing and reads no JSON (a non-streamed answer at
    /// once), so that it costs the shared CPU as little as an engine can.
    quiet: bool,
}

impl FakeEngine {
    pub async fn start(name: &str) -> Self {
        Self::start_on(name, "127.0.0.1:0".parse().unwrap()).await
    }

    /// Starts on a given address (a restart on the same port).
    pub async fn start_on(name: &str, addr: SocketAddr) -> Self {
        Self::start_with(name, addr, false).await
    }

    /// The benchmark's engine (`bench/epp-latency.sh`): answers every request at once with a
    /// fixed non-streamed completion, records nothing ([`served`](Self::served) stays 0) and
    /// parses nothing.
    pub async fn start_quiet(name: &str) -> Self {
        Self::start_with(name, "127.0.0.1:0".parse().unwrap(), true).await
    }

    async fn start_with(name: &str, addr: SocketAddr, quiet: bool) -> Self {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let state = EngineState {
            name: name.to_owned(),
            seen: seen.clone(),
            quiet,
        };
        let app = axum::Router::new()
            .fallback(engine_handler)
            .with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            name: name.to_owned(),
            addr,
            seen,
            task,
        }
    }

    pub fn endpoint(&self) -> String {
        self.addr.to_string()
    }

    /// Requests served so far (`/metrics` scrapes excluded).
    pub fn served(&self) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.path != "/metrics")
            .count()
    }

    pub fn last(&self) -> Option<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|s| s.path != "/metrics")
            .cloned()
    }

    /// Stops listening (connections are refused from now on).
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn engine_handler(State(state): State<EngineState>, request: Request) -> Response {
    if state.quiet {
        // Drain the body (as an engine reads the request), answer a fixed completion.
        let _ = axum::body::to_bytes(request.into_body(), 64 << 20).await;
        return Response::builder()
            .header("x-engine", state.name.as_str())
            .header("content-type", "application/json")
            .body(Body::from(QUIET_ANSWER))
            .unwrap();
    }
    let path = request.uri().path().to_owned();
    let (destination, delay) = {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        (
            header("x-gateway-destination-endpoint"),
            header("x-test-delay-ms").and_then(|v| v.parse::<u64>().ok()),
        )
    };
    let body = axum::body::to_bytes(request.into_body(), 64 << 20)
        .await
        .unwrap_or_default();
    let body = String::from_utf8_lossy(&body).to_string();
    if path == "/metrics" {
        let text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"org/chat\"} 0\n\
                    # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"org/chat\"} 0\n\
                    # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"org/chat\"} 0.1\n";
        return Response::new(Body::from(text));
    }
    let stream = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("stream").and_then(|s| s.as_bool()))
        .unwrap_or(false);
    state.seen.lock().unwrap().push(Seen {
        path,
        body,
        destination,
    });
    if let Some(ms) = delay {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut builder = Response::builder().header("x-engine", state.name.as_str());
    if stream {
        builder = builder.header("content-type", "text/event-stream");
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(4);
        let chunks = stream_chunks(&state.name, STREAM_TOKENS);
        tokio::spawn(async move {
            for chunk in chunks {
                if tx.send(Ok(bytes::Bytes::from(chunk))).await.is_err() {
                    return;
                }
                tokio::time::sleep(STREAM_GAP).await;
            }
        });
        return builder
            .body(Body::from_stream(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
            .unwrap();
    }
    let answer = serde_json::json!({
        "object": "chat.completion",
        "model": MODEL,
        "engine": state.name,
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": "ok" } }],
    });
    builder
        .header("content-type", "application/json")
        .body(Body::from(answer.to_string()))
        .unwrap()
}

/// The quiet engine's answer (a chat completion of one word).
const QUIET_ANSWER: &str = r#"{"object":"chat.completion","model":"org/chat","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}"#;

/// What the picker answered one request with.
#[derive(Debug, Clone, Default)]
pub struct PickerAnswer {
    /// The destination header's value (empty without one).
    pub header: String,
    /// The `envoy.lb` metadata's value (empty without one).
    pub metadata: String,
    /// An immediate response's status (0 without one).
    pub immediate_status: i32,
    /// The request body as returned (full duplex).
    pub body: Vec<u8>,
}

impl PickerAnswer {
    pub fn endpoints(&self) -> Vec<String> {
        self.header
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }
}

fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).to_owned(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream: false,
        ..Default::default()
    }
}

/// Plays Envoy (FULL_DUPLEX_STREAMED request body, `chunk` bytes a message): sends headers and
/// the body, and collects the picker's answers until it has answered the whole request.
pub async fn ext_proc_request(
    picker: SocketAddr,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
    chunk: usize,
) -> PickerAnswer {
    ext_proc_open(picker, path, extra_headers, body, chunk)
        .await
        .0
}

/// [`ext_proc_request`] of an OpenAI chat completion: `body` in 4 KiB chunks.
pub async fn chat_completion(picker: SocketAddr, body: &str) -> PickerAnswer {
    ext_proc_request(picker, "/v1/chat/completions", &[], body.as_bytes(), 4096).await
}

/// The open side of an ext_proc exchange: while it lives, the request is in flight.
pub type OpenExchange = (
    tokio::sync::mpsc::Sender<ProcessingRequest>,
    tonic::Streaming<ProcessingResponse>,
);

/// [`ext_proc_request`] that leaves the stream open (the request stays in flight at its
/// endpoint until the returned exchange is dropped).
pub async fn ext_proc_open(
    picker: SocketAddr,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
    chunk: usize,
) -> (PickerAnswer, OpenExchange) {
    let mut client = ExternalProcessorClient::connect(format!("http://{picker}"))
        .await
        .expect("connect to the picker");
    let mut pairs = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "gateway"),
        ("content-type", "application/json"),
    ];
    pairs.extend_from_slice(extra_headers);
    let mut messages = vec![ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::None as i32,
            ..Default::default()
        }),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            end_of_stream: body.is_empty(),
            ..headers(&pairs)
        })),
        ..Default::default()
    }];
    if !body.is_empty() {
        let pieces: Vec<&[u8]> = body.chunks(chunk.max(1)).collect();
        let last = pieces.len() - 1;
        for (i, piece) in pieces.into_iter().enumerate() {
            messages.push(ProcessingRequest {
                request: Some(processing_request::Request::RequestBody(HttpBody {
                    body: piece.to_vec(),
                    end_of_stream: i == last,
                    ..Default::default()
                })),
                ..Default::default()
            });
        }
    }
    // Keep the request stream open until the answer is complete, as Envoy does.
    let (tx, rx) = tokio::sync::mpsc::channel(messages.len() + 1);
    for m in messages {
        tx.send(m).await.unwrap();
    }
    let mut responses = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("process")
        .into_inner();
    let mut answer = PickerAnswer::default();
    let read = async {
        while let Some(message) = responses.message().await.expect("picker stream") {
            if collect(&mut answer, message, body.is_empty()) {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the picker answered within 10 s");
    (answer, (tx, responses))
}

/// Folds one response into `answer`; true when the request side is fully answered.
fn collect(answer: &mut PickerAnswer, message: ProcessingResponse, no_body: bool) -> bool {
    if let Some(metadata) = &message.dynamic_metadata
        && let Some(value) = metadata.fields.get("envoy.lb")
        && let Some(envoy_types::pb::google::protobuf::value::Kind::StructValue(inner)) =
            &value.kind
        && let Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(list)) = inner
            .fields
            .get("x-gateway-destination-endpoint")
            .and_then(|v| v.kind.clone())
            .as_ref()
    {
        answer.metadata = list.clone();
    }
    match message.response {
        Some(processing_response::Response::RequestHeaders(h)) => {
            if let Some(mutation) = h.response.and_then(|r| r.header_mutation) {
                for option in mutation.set_headers {
                    if let Some(header) = option.header
                        && header.key == "x-gateway-destination-endpoint"
                    {
                        answer.header = String::from_utf8(header.raw_value).unwrap();
                    }
                }
            }
            no_body
        }
        Some(processing_response::Response::RequestBody(b)) => {
            let Some(streamed) = b
                .response
                .and_then(|r| r.body_mutation)
                .and_then(|m| m.mutation)
            else {
                return false;
            };
            match streamed {
                envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation::StreamedResponse(s) => {
                    answer.body.extend_from_slice(&s.body);
                    s.end_of_stream
                }
                _ => false,
            }
        }
        Some(processing_response::Response::ImmediateResponse(i)) => {
            answer.immediate_status = i.status.map(|s| s.code).unwrap_or(0);
            true
        }
        _ => false,
    }
}

/// A binary of another workspace package, built next to this test's (`cargo test
/// --workspace` builds every package's binaries before running tests).
pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built: run `cargo build -p inferencecache-sidecar` (cargo test --workspace \
         builds it)",
        path.display()
    );
    path
}

/// Starts the server with the picker on a free loopback port (tenant `t`, tokenizers from
/// `models`) and `extra` flags; returns it and the picker's address.
pub fn picker_server(
    dir: &Path,
    models: &Path,
    extra: &[&str],
) -> (crate::common::ServerProcess, SocketAddr) {
    let bind = format!("127.0.0.1:{}", crate::common::free_port());
    let mut args = vec![
        "--tokenizer-models-dir",
        models.to_str().unwrap(),
        "--epp-bind-address",
        &bind,
        "--epp-tenant",
        "t",
    ];
    args.extend_from_slice(extra);
    let server = crate::common::ServerProcess::start(dir, &args);
    (server, bind.parse().unwrap())
}
