//! Server-side tokenization for InferenceCache `prompt_text` lookups (`server.md` §7.3).
//!
//! Gateways that have no tokenizer send the raw prompt. To route by cache content the server
//! must produce the **same token ids the engine caches**: render the model's chat template for a
//! single user message, then encode the result. This crate does exactly that and nothing else;
//! fingerprinting, limits, deadlines and response echo rules stay in the server.
//!
//! # Loading
//!
//! [`Tokenizers::load`] walks a models directory once at startup. Every directory *below* the
//! root that contains a `tokenizer.json` (or a `*.tiktoken` file) is a model whose id is its
//! slash-joined path relative to the root, e.g. `<root>/Qwen/Qwen2.5-0.5B-Instruct/` →
//! `Qwen/Qwen2.5-0.5B-Instruct`. The walk does not descend into a model directory, skips
//! unreadable entries, skips ids that fail [`is_safe_model_id`] (WARN) and models that fail to
//! load (WARN; a `*.tiktoken`-only model always does, as this build has no tiktoken loader), and
//! logs the loaded count at INFO. A missing directory is a WARN and loads nothing. Loading never
//! fails as a whole. The chat template comes from `tokenizer_config.json` beside the tokenizer
//! (`chat_template`, a string or a list of `{name, template}` from which `default` — else the
//! first — is used), falling back to a `chat_template.jinja` file.
//!
//! # Encoding
//!
//! [`Tokenizers::encode_chat`] renders `messages = [{role: "user", content: prompt}]` with
//! `add_generation_prompt = true` and the special tokens from the config (`bos_token`,
//! `eos_token`, ...); `tools` and `documents` are left **undefined** (not empty lists). The
//! environment mirrors the one `transformers` uses: `trim_blocks`, `lstrip_blocks`, loop
//! controls, Python string methods, and the helpers `raise_exception(msg)` (becomes
//! [`TokenizeError::Template`]), `tojson` (Python `json.dumps` output, `indent` and friends
//! accepted) and `strftime_now(fmt)` (UTC). The rendered text is then encoded **without**
//! adding special tokens (the template already wrote them). A model without a chat template
//! encodes the raw prompt, also without special tokens: that is what an engine's completion
//! endpoint does with a template-less model after the gateway's own formatting, and it keeps
//! such models usable instead of silently unavailable.
//!
//! [`Tokenizers::encode_raw`] (tests and tools) encodes text directly, **adding** special tokens,
//! and rejects text containing NUL.
//!
//! # Segment cache
//!
//! [`Tokenizers::with_segment_cache`] adds a cache, bounded in bytes and shared by every model,
//! from the text between two added tokens (`<|im_start|>`, `<|im_end|>`, ...) to its ids: a
//! chat prompt's system prompt and earlier turns are encoded once, and only the new pieces of a
//! later prompt are. The ids are the same as without it (the tokenizer splits on added tokens
//! before anything else; the module `segments` says why, and which tokenizers it refuses: those
//! encode whole). It serves the chat encodes (no added special tokens), not
//! [`Tokenizers::encode_raw`]. [`PromptTokenizer::segment_cache_stats`] reports its counters.
//!
//! # Safety rules
//!
//! A request-supplied model id is only ever looked up in the map built at startup: it is never
//! joined onto a path and nothing is ever downloaded. Ids that are empty, absolute, contain `\`,
//! start with a drive prefix (`C:/`), are not path-clean or have an empty, `.` or `..` segment
//! are rejected up front ([`TokenizeError::UnsafeModelId`]); see [`is_safe_model_id`].
//!
//! # Cost: call off the async runtime
//!
//! Rendering and encoding are **CPU-bound** and take from microseconds to tens of milliseconds
//! for a 1 MiB prompt. They never block on I/O, but they must not run on an async runtime's
//! worker threads: the server should call them via `tokio::task::spawn_blocking` (or a
//! dedicated pool), bound the concurrency, and abandon the result when the deadline fires.
//! [`Tokenizers`] is `Send + Sync` and meant to be shared behind an `Arc`.
//!
//! What a call does not pay for: the tokenizer is never cloned or configured per call (one
//! instance per model, truncation and padding cleared at load); a single text is encoded on the
//! calling thread (`encode_fast` of one input, no rayon); the chat template is compiled once at
//! load (a call only looks it up and renders); and with the segment cache, only the pieces not
//! seen before are encoded.
//!
//! # Features
//!
//! `hf` (default): the `tokenizers` (pure-Rust `fancy-regex` backend) and `minijinja`
//! dependencies. Without it the crate keeps the same API, [`Tokenizers::load`] logs that support
//! is compiled out and loads nothing, and every lookup fails with
//! [`TokenizeError::UnknownModel`].

mod calendar;
#[cfg(feature = "hf")]
mod hf;
#[cfg(feature = "hf")]
mod json;
mod safety;
#[cfg(feature = "hf")]
mod segments;
#[cfg(feature = "hf")]
mod strftime;

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use calendar::civil_from_days;
pub use safety::is_safe_model_id;

#[cfg(feature = "hf")]
use hf::Model;

/// Uninhabited stand-in for a loaded model when the `hf` feature is off.
#[cfg(not(feature = "hf"))]
enum Model {}

/// Directory nesting below the root beyond which the walk stops (guards symlink loops).
const MAX_WALK_DEPTH: usize = 32;

/// Why a text could not be tokenized. Every variant means "fail open" for a lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The model id fails [`is_safe_model_id`]; it was not looked up.
    UnsafeModelId,
    /// No model with this id was loaded at startup (always the case without the `hf` feature).
    UnknownModel,
    /// The chat template failed to render (including `raise_exception` from the template).
    Template(String),
    /// The tokenizer rejected the text.
    Encode(String),
    /// The input is not acceptable (e.g. an embedded NUL for raw encoding).
    InvalidInput(String),
    /// The deadline passed before encoding started ([`PromptTokenizer::encode_chat_until`]).
    DeadlineExceeded,
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizeError::UnsafeModelId => f.write_str("unsafe model id"),
            TokenizeError::UnknownModel => f.write_str("unknown model"),
            TokenizeError::Template(m) => write!(f, "chat template error: {m}"),
            TokenizeError::Encode(m) => write!(f, "encode error: {m}"),
            TokenizeError::InvalidInput(m) => write!(f, "invalid input: {m}"),
            TokenizeError::DeadlineExceeded => f.write_str("deadline exceeded before encoding"),
        }
    }
}

impl std::error::Error for TokenizeError {}

/// One message of a chat conversation (OpenAI `messages[]` with text content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, … passed to the template as written.
    pub role: String,
    /// The message text.
    pub content: String,
}

/// The segment cache's counters ([`Tokenizers::with_segment_cache`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentCacheStats {
    /// The configured bound, in bytes.
    pub capacity_bytes: u64,
    /// Estimated bytes held (text, ids and per-entry overhead).
    pub bytes: u64,
    /// Pieces held.
    pub entries: u64,
    /// Pieces whose ids came from the cache.
    pub hits: u64,
    /// Pieces encoded (and stored unless too large).
    pub misses: u64,
    /// Ids that came from the cache.
    pub hit_tokens: u64,
    /// Chat encodes of models the cache cannot serve (encoded whole).
    pub plain_encodes: u64,
}

/// What the server needs from a tokenizer, so tests can inject a double.
pub trait PromptTokenizer: Send + Sync {
    /// Token ids of a whole conversation rendered with `model_id`'s chat template (with the
    /// generation prompt), encoded without adding special tokens: what an engine's
    /// `/v1/chat/completions` caches. The default renders a single user message through
    /// [`encode_chat_until`](Self::encode_chat_until) and refuses anything else.
    fn encode_messages_until(
        &self,
        model_id: &str,
        messages: &[ChatMessage],
        deadline: Instant,
    ) -> Result<Vec<u32>, TokenizeError> {
        match messages {
            [only] if only.role == "user" => {
                self.encode_chat_until(model_id, &only.content, deadline)
            }
            _ => Err(TokenizeError::InvalidInput(
                "this tokenizer encodes single user messages only".to_owned(),
            )),
        }
    }

    /// Token ids of a raw completion prompt (`/v1/completions`): the text encoded with the
    /// tokenizer's special tokens, no template. The default refuses (no raw encoder).
    fn encode_text_until(
        &self,
        model_id: &str,
        text: &str,
        deadline: Instant,
    ) -> Result<Vec<u32>, TokenizeError> {
        let _ = (model_id, text, deadline);
        Err(TokenizeError::InvalidInput(
            "this tokenizer has no raw text encoder".to_owned(),
        ))
    }

    /// Token ids of `prompt` sent as one user message to `model_id` (see the crate docs).
    fn encode_chat(&self, model_id: &str, prompt: &str) -> Result<Vec<u32>, TokenizeError>;

    /// The segment cache's counters, when there is one (the default: none).
    fn segment_cache_stats(&self) -> Option<SegmentCacheStats> {
        None
    }

    /// As [`encode_chat`](Self::encode_chat), but returns
    /// [`TokenizeError::DeadlineExceeded`] instead of starting the (uncancellable) encoding once
    /// `deadline` has passed. The default checks only before starting; [`Tokenizers`] also
    /// checks between rendering and encoding.
    fn encode_chat_until(
        &self,
        model_id: &str,
        prompt: &str,
        deadline: Instant,
    ) -> Result<Vec<u32>, TokenizeError> {
        if Instant::now() >= deadline {
            return Err(TokenizeError::DeadlineExceeded);
        }
        self.encode_chat(model_id, prompt)
    }
}

/// Counts from [`Tokenizers::load`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Models loaded and available.
    pub loaded: usize,
    /// Model directories that failed to load (including `*.tiktoken`-only ones).
    pub failed: usize,
    /// Model directories skipped because their id failed [`is_safe_model_id`].
    pub unsafe_ids: usize,
}

/// The models loaded at startup, keyed by model id.
pub struct Tokenizers {
    models: BTreeMap<String, Model>,
    stats: LoadStats,
    #[cfg(feature = "hf")]
    segment_cache: Option<segments::SegmentCache>,
}

impl Default for Tokenizers {
    fn default() -> Self {
        Tokenizers::empty()
    }
}

impl fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizers")
            .field("models", &self.models.keys().collect::<Vec<_>>())
            .field("stats", &self.stats)
            .finish()
    }
}

/// A model directory found by the walk.
struct Candidate {
    id: String,
    dir: PathBuf,
    has_tokenizer_json: bool,
}

impl Tokenizers {
    /// No models: every lookup is [`TokenizeError::UnknownModel`].
    pub fn empty() -> Tokenizers {
        Tokenizers {
            models: BTreeMap::new(),
            stats: LoadStats::default(),
            #[cfg(feature = "hf")]
            segment_cache: None,
        }
    }

    /// Adds the segment cache (crate docs), holding about `capacity_bytes` at most; 0 means
    /// none. Models whose tokenizer it cannot serve are logged once (INFO) and encode whole.
    #[must_use]
    pub fn with_segment_cache(self, capacity_bytes: u64) -> Tokenizers {
        #[cfg(feature = "hf")]
        let out = {
            let mut out = self;
            out.segment_cache = (capacity_bytes > 0).then(|| {
                for (id, model) in &out.models {
                    if let Some(reason) = model.uncacheable() {
                        tracing::info!(model = %id, %reason, "tokenize: segment cache off for this model, prompts encode whole");
                    }
                }
                segments::SegmentCache::new(capacity_bytes)
            });
            out
        };
        #[cfg(not(feature = "hf"))]
        let out = {
            let _ = capacity_bytes;
            self
        };
        out
    }

    /// The segment cache's counters, when [`with_segment_cache`](Self::with_segment_cache)
    /// added one.
    pub fn segment_cache_stats(&self) -> Option<SegmentCacheStats> {
        #[cfg(feature = "hf")]
        {
            self.segment_cache
                .as_ref()
                .map(segments::SegmentCache::stats)
        }
        #[cfg(not(feature = "hf"))]
        {
            None
        }
    }

    /// Loads every model below `dir` (see the crate docs). Never fails; problems are logged.
    pub fn load(dir: &Path) -> Tokenizers {
        let mut out = Tokenizers::empty();
        if !cfg!(feature = "hf") {
            tracing::warn!(
                dir = %dir.display(),
                "tokenize: tokenizer support is compiled out (feature `hf`), no models loaded"
            );
            return out;
        }
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                tracing::warn!(dir = %dir.display(), "tokenize: models dir is not a directory, no models loaded");
                return out;
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "tokenize: models dir is missing or unreadable, no models loaded");
                return out;
            }
        }
        let mut candidates = Vec::new();
        let mut ancestors = HashSet::new();
        if let Ok(canon) = std::fs::canonicalize(dir) {
            ancestors.insert(canon);
        }
        walk(dir, &mut Vec::new(), &mut ancestors, &mut candidates);

        for cand in candidates {
            if !is_safe_model_id(&cand.id) {
                tracing::warn!(model = %cand.id, dir = %cand.dir.display(), "tokenize: unsafe model id, skipped");
                out.stats.unsafe_ids += 1;
                continue;
            }
            if !cand.has_tokenizer_json {
                tracing::warn!(model = %cand.id, dir = %cand.dir.display(), "tokenize: tiktoken models are not supported by this build, skipped");
                out.stats.failed += 1;
                continue;
            }
            match load_model(&cand.dir) {
                Ok(mut model) => {
                    set_slot(
                        &mut model,
                        u32::try_from(out.models.len()).unwrap_or(u32::MAX),
                    );
                    tracing::debug!(model = %cand.id, "tokenize: model loaded");
                    out.models.insert(cand.id, model);
                    out.stats.loaded += 1;
                }
                Err(error) => {
                    tracing::warn!(model = %cand.id, dir = %cand.dir.display(), %error, "tokenize: model failed to load, skipped");
                    out.stats.failed += 1;
                }
            }
        }
        tracing::info!(
            dir = %dir.display(),
            loaded = out.stats.loaded,
            failed = out.stats.failed,
            unsafe_ids = out.stats.unsafe_ids,
            "tokenize: models loaded"
        );
        out
    }

    /// Counts from loading.
    pub fn stats(&self) -> LoadStats {
        self.stats
    }

    /// Number of loaded models.
    pub fn len(&self) -> usize {
        self.models.len()
    }

    /// Whether no model is loaded.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// Loaded model ids, sorted.
    pub fn model_ids(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }

    /// Whether `model_id` is loaded (false for unsafe ids).
    pub fn contains(&self, model_id: &str) -> bool {
        self.get(model_id).is_ok()
    }

    /// Whether the model is loaded and has a chat template.
    pub fn has_chat_template(&self, model_id: &str) -> bool {
        match self.get(model_id) {
            Ok(model) => model_has_chat_template(model),
            Err(_) => false,
        }
    }

    /// The text [`encode_chat`](Self::encode_chat) encodes: the rendered chat template for one
    /// user message, or the prompt itself for a model without a template.
    pub fn render_chat(&self, model_id: &str, prompt: &str) -> Result<String, TokenizeError> {
        render(self.get(model_id)?, prompt)
    }

    /// Token ids for `prompt` as one user message (rendered template, encoded without adding
    /// special tokens).
    pub fn encode_chat(&self, model_id: &str, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        let model = self.get(model_id)?;
        let text = render(model, prompt)?;
        self.encode_with(model, &text, false)
    }

    /// Encodes `text` directly, adding the tokenizer's special tokens (BOS/EOS per its
    /// post-processor). Text containing NUL is rejected.
    pub fn encode_raw(&self, model_id: &str, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let model = self.get(model_id)?;
        if text.contains('\0') {
            return Err(TokenizeError::InvalidInput(
                "text contains a NUL character".to_owned(),
            ));
        }
        self.encode_with(model, text, true)
    }

    /// Encodes through the segment cache when there is one.
    fn encode_with(
        &self,
        model: &Model,
        text: &str,
        add_special: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        #[cfg(feature = "hf")]
        {
            model.encode(text, add_special, self.segment_cache.as_ref())
        }
        #[cfg(not(feature = "hf"))]
        {
            let _ = (text, add_special);
            match *model {}
        }
    }

    fn get(&self, model_id: &str) -> Result<&Model, TokenizeError> {
        if !is_safe_model_id(model_id) {
            return Err(TokenizeError::UnsafeModelId);
        }
        self.models.get(model_id).ok_or(TokenizeError::UnknownModel)
    }
}

impl PromptTokenizer for Tokenizers {
    fn encode_chat(&self, model_id: &str, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        Tokenizers::encode_chat(self, model_id, prompt)
    }

    fn encode_messages_until(
        &self,
        model_id: &str,
        messages: &[ChatMessage],
        deadline: Instant,
    ) -> Result<Vec<u32>, TokenizeError> {
        if Instant::now() >= deadline {
            return Err(TokenizeError::DeadlineExceeded);
        }
        let model = self.get(model_id)?;
        let text = render_messages(model, messages)?;
        if Instant::now() >= deadline {
            return Err(TokenizeError::DeadlineExceeded);
        }
        self.encode_with(model, &text, false)
    }

    fn segment_cache_stats(&self) -> Option<SegmentCacheStats> {
        Tokenizers::segment_cache_stats(self)
    }

    fn encode_text_until(
        &self,
        model_id: &str,
        text: &str,
        deadline: Instant,
    ) -> Result<Vec<u32>, TokenizeError> {
        if Instant::now() >= deadline {
            return Err(TokenizeError::DeadlineExceeded);
        }
        self.encode_raw(model_id, text)
    }

    fn encode_chat_until(
        &self,
        model_id: &str,
        prompt: &str,
        deadline: Instant,
    ) -> Result<Vec<u32>, TokenizeError> {
        if Instant::now() >= deadline {
            return Err(TokenizeError::DeadlineExceeded);
        }
        let model = self.get(model_id)?;
        let text = render(model, prompt)?;
        if Instant::now() >= deadline {
            return Err(TokenizeError::DeadlineExceeded);
        }
        self.encode_with(model, &text, false)
    }
}

#[cfg(feature = "hf")]
fn load_model(dir: &Path) -> Result<Model, String> {
    Model::load(dir)
}

#[cfg(not(feature = "hf"))]
fn load_model(_dir: &Path) -> Result<Model, String> {
    Err("tokenizer support is compiled out".to_owned())
}

#[cfg(feature = "hf")]
fn render(model: &Model, prompt: &str) -> Result<String, TokenizeError> {
    model.render_chat(prompt)
}

#[cfg(not(feature = "hf"))]
fn render(model: &Model, _prompt: &str) -> Result<String, TokenizeError> {
    match *model {}
}

#[cfg(feature = "hf")]
fn render_messages(model: &Model, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
    model.render_messages(messages)
}

#[cfg(not(feature = "hf"))]
fn render_messages(model: &Model, _messages: &[ChatMessage]) -> Result<String, TokenizeError> {
    match *model {}
}

#[cfg(feature = "hf")]
fn set_slot(model: &mut Model, slot: u32) {
    model.set_slot(slot);
}

#[cfg(not(feature = "hf"))]
fn set_slot(model: &mut Model, _slot: u32) {
    match *model {}
}

#[cfg(feature = "hf")]
fn model_has_chat_template(model: &Model) -> bool {
    model.has_chat_template()
}

#[cfg(not(feature = "hf"))]
fn model_has_chat_template(model: &Model) -> bool {
    match *model {}
}

/// Collects model directories below `dir`; `rel` holds the path segments from the root and
/// `ancestors` the canonical paths of the directories on the way down.
fn walk(
    dir: &Path,
    rel: &mut Vec<String>,
    ancestors: &mut HashSet<PathBuf>,
    out: &mut Vec<Candidate>,
) {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "tokenize: unreadable directory, skipped");
            return;
        }
    };
    // Sorted, so the walk (and its log lines) is deterministic.
    let mut names: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    names.sort();

    let mut subdirs = Vec::new();
    let mut has_tokenizer_json = false;
    let mut has_tiktoken = false;
    for name in names {
        let path = dir.join(&name);
        // `metadata` follows symlinks, so symlinked model dirs and files (HF cache) work.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            subdirs.push(name);
        } else if meta.is_file() {
            if name == "tokenizer.json" {
                has_tokenizer_json = true;
            } else if Path::new(&name)
                .extension()
                .is_some_and(|ext| ext == "tiktoken")
            {
                has_tiktoken = true;
            }
        }
    }

    if has_tokenizer_json || has_tiktoken {
        if rel.is_empty() {
            tracing::warn!(dir = %dir.display(), "tokenize: tokenizer files directly in the models dir are ignored; put each model in a sub-directory");
        } else {
            out.push(Candidate {
                id: rel.join("/"),
                dir: dir.to_path_buf(),
                has_tokenizer_json,
            });
            return;
        }
    }
    if rel.len() >= MAX_WALK_DEPTH {
        tracing::warn!(dir = %dir.display(), "tokenize: directory nesting too deep, not descending");
        return;
    }
    for name in subdirs {
        let path = dir.join(&name);
        let Some(segment) = name.to_str() else {
            tracing::warn!(dir = %path.display(), "tokenize: directory name is not UTF-8, skipped");
            continue;
        };
        // A symlink back to a directory on the current path would loop: skip it. (Aliases
        // elsewhere are fine: each alias is its own model id.)
        let Ok(canon) = std::fs::canonicalize(&path) else {
            continue;
        };
        if !ancestors.insert(canon.clone()) {
            tracing::warn!(dir = %path.display(), "tokenize: directory symlink loop, skipped");
            continue;
        }
        rel.push(segment.to_owned());
        walk(&path, rel, ancestors, out);
        rel.pop();
        ancestors.remove(&canon);
    }
}
