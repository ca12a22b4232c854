//! Bearer-token authentication (spec `server.md` §9): the control plane (`:8081`, D2) and the
//! producer RPCs (`ReportCacheState`, `PublishEvent`, D3).
//!
//! One [`TokenStore`] per audience holds the SHA-256 digests of the tokens of one file. A store
//! re-reads its file when the file's mtime, size or inode changes; the check runs lazily on the
//! request path at most once per second. A failed read keeps the last good set. Tokens are never
//! logged and never kept in clear text after loading.

use crate::metrics::{AuthRoute, Metrics};
use arc_swap::ArcSwap;
use axum::http::{HeaderMap, StatusCode, header};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tracing::{error, info};

/// Minimum time between two stat calls on a token file.
pub const RELOAD_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Message of the producer rejection (§9.2).
pub const PRODUCER_UNAUTHENTICATED: &str = "missing or invalid producer token";

/// Who a token file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// `/snapshot` and `/probe`.
    Controller,
    /// `/policy`.
    Policy,
    /// `ReportCacheState` and `PublishEvent`.
    Producer,
}

impl Audience {
    /// The `audience` log attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            Audience::Controller => "controller",
            Audience::Policy => "policy",
            Audience::Producer => "producer",
        }
    }
}

/// Tokens of a token file's text: every line non-empty after trimming and not starting with `#`.
pub fn parse_tokens(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// Reads a token file and returns its token count (startup validation, §3 step 3).
pub fn count_tokens_in_file(path: &Path) -> std::io::Result<usize> {
    let text = read_text(path)?;
    Ok(parse_tokens(&text).len())
}

fn read_text(path: &Path) -> std::io::Result<String> {
    let bytes = std::fs::read(path)?;
    String::from_utf8(bytes).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "token file is not valid UTF-8",
        )
    })
}

type TokenDigest = [u8; 32];

fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// Equality of two digests without early exit.
fn digests_equal(a: &TokenDigest, b: &TokenDigest) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Identity of a file version: a change of any field triggers a re-read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(meta);
        #[cfg(not(unix))]
        let inode = 0;
        Self {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode,
        }
    }
}

struct ReloadState {
    last_check: Instant,
    stamp: Option<FileStamp>,
    /// Last reported failure, so a persistent failure is logged once.
    last_error: Option<String>,
}

/// The accepted tokens of one audience, loaded from one file.
pub struct TokenStore {
    audience: Audience,
    path: PathBuf,
    digests: ArcSwap<Vec<TokenDigest>>,
    reload: Mutex<ReloadState>,
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStore")
            .field("audience", &self.audience)
            .field("path", &self.path)
            .field("tokens", &self.len())
            .finish()
    }
}

impl TokenStore {
    /// Loads `path`. Startup rule (§3 step 3): a missing or unreadable file, or one holding no
    /// token, is an error.
    pub fn open(audience: Audience, path: impl Into<PathBuf>) -> anyhow::Result<Self> {
        let path = path.into();
        let flag = match audience {
            Audience::Controller => "--controller-token-file",
            Audience::Policy => "--policy-token-file",
            Audience::Producer => "--producer-token-file",
        };
        let meta = std::fs::metadata(&path)
            .map_err(|e| anyhow::anyhow!("{flag} {}: {e}", path.display()))?;
        let text =
            read_text(&path).map_err(|e| anyhow::anyhow!("{flag} {}: {e}", path.display()))?;
        let digests: Vec<TokenDigest> = parse_tokens(&text).into_iter().map(digest).collect();
        if digests.is_empty() {
            anyhow::bail!("{flag} {}: the file holds no token", path.display());
        }
        Ok(Self {
            audience,
            path,
            digests: ArcSwap::from_pointee(digests),
            reload: Mutex::new(ReloadState {
                last_check: Instant::now(),
                stamp: Some(FileStamp::of(&meta)),
                last_error: None,
            }),
        })
    }

    pub fn audience(&self) -> Audience {
        self.audience
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens currently accepted.
    pub fn len(&self) -> usize {
        self.digests.load().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-reads the file if it changed, at most once per [`RELOAD_CHECK_INTERVAL`]. Concurrent
    /// callers never wait: while one checks, the others use the current set.
    pub fn refresh(&self) {
        let Some(mut state) = self.reload.try_lock() else {
            return;
        };
        if state.last_check.elapsed() < RELOAD_CHECK_INTERVAL {
            return;
        }
        self.check_locked(&mut state);
    }

    /// Checks the file now, ignoring the once-per-second throttle.
    pub fn refresh_now(&self) {
        let mut state = self.reload.lock();
        self.check_locked(&mut state);
    }

    fn check_locked(&self, state: &mut ReloadState) {
        state.last_check = Instant::now();
        let result = std::fs::metadata(&self.path).and_then(|meta| {
            let stamp = FileStamp::of(&meta);
            if state.stamp.as_ref() == Some(&stamp) {
                return Ok(None);
            }
            let text = read_text(&self.path)?;
            Ok(Some((stamp, text)))
        });
        match result {
            Ok(None) => {}
            Ok(Some((stamp, text))) => {
                let digests: Vec<TokenDigest> =
                    parse_tokens(&text).into_iter().map(digest).collect();
                let count = digests.len();
                self.digests.store(Arc::new(digests));
                state.stamp = Some(stamp);
                state.last_error = None;
                info!(
                    audience = self.audience.as_str(),
                    count, "auth_tokens_reloaded"
                );
            }
            Err(err) => {
                let err = err.to_string();
                if state.last_error.as_deref() != Some(err.as_str()) {
                    error!(
                        audience = self.audience.as_str(),
                        file = %self.path.display(),
                        err = %err,
                        "auth_tokens_reload_failed"
                    );
                    state.last_error = Some(err);
                }
                // Forget the stamp so the file is re-read as soon as it is readable again.
                state.stamp = None;
            }
        }
    }

    /// Whether `presented` (a token digest) is one of the accepted tokens. Every configured
    /// digest is compared, without early exit.
    fn contains(&self, presented: &TokenDigest) -> bool {
        let set = self.digests.load();
        let mut found = false;
        for d in set.iter() {
            found |= digests_equal(d, presented);
        }
        found
    }
}

/// Which token files are configured (from the flags).
#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    pub insecure_disable_auth: bool,
    pub controller_token_file: Option<PathBuf>,
    pub policy_token_file: Option<PathBuf>,
    pub producer_token_file: Option<PathBuf>,
}

/// How the control-plane routes are guarded (§9.1 "Modes").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlMode {
    /// `--insecure-disable-auth`: no checks, no counters.
    Insecure,
    /// Neither a controller nor a policy token file: no checks, no counters, loopback listener.
    LoopbackOpen,
    /// Every request is checked and counted.
    Checked,
}

/// The loaded token stores of every configured audience.
#[derive(Debug, Default)]
pub struct TokenStores {
    insecure: bool,
    controller: Option<TokenStore>,
    policy: Option<TokenStore>,
    producer: Option<TokenStore>,
}

impl TokenStores {
    /// Loads every configured file; any failure is a startup error (exit 2).
    pub fn load(config: &AuthConfig) -> anyhow::Result<Self> {
        if config.insecure_disable_auth
            && (config.controller_token_file.is_some() || config.policy_token_file.is_some())
        {
            anyhow::bail!(
                "--insecure-disable-auth cannot be combined with --controller-token-file or \
                 --policy-token-file"
            );
        }
        let open = |aud, p: &Option<PathBuf>| -> anyhow::Result<Option<TokenStore>> {
            p.as_ref().map(|p| TokenStore::open(aud, p)).transpose()
        };
        Ok(Self {
            insecure: config.insecure_disable_auth,
            controller: open(Audience::Controller, &config.controller_token_file)?,
            policy: open(Audience::Policy, &config.policy_token_file)?,
            producer: open(Audience::Producer, &config.producer_token_file)?,
        })
    }

    /// No token file at all and auth not disabled: the loopback-only open mode.
    pub fn none() -> Self {
        Self::default()
    }

    pub fn control_mode(&self) -> ControlMode {
        if self.insecure {
            ControlMode::Insecure
        } else if self.controller.is_none() && self.policy.is_none() {
            ControlMode::LoopbackOpen
        } else {
            ControlMode::Checked
        }
    }

    pub fn store(&self, audience: Audience) -> Option<&TokenStore> {
        match audience {
            Audience::Controller => self.controller.as_ref(),
            Audience::Policy => self.policy.as_ref(),
            Audience::Producer => self.producer.as_ref(),
        }
    }

    /// Current token count of an audience (0 when unconfigured).
    pub fn token_count(&self, audience: Audience) -> usize {
        self.store(audience).map_or(0, TokenStore::len)
    }
}

/// §3 step 5: INFO `controller_auth_enabled` or WARN `controller_auth_disabled`, and WARN
/// `snapshot_listener_loopback_only` when an empty host was bound to loopback.
pub fn log_auth_summary(
    stores: &TokenStores,
    snapshot_addr: std::net::SocketAddr,
    loopback_forced: bool,
) {
    match stores.control_mode() {
        ControlMode::Insecure => {
            tracing::warn!(reason = "insecure_flag", "controller_auth_disabled");
        }
        ControlMode::LoopbackOpen => {
            tracing::warn!(
                reason = "no_tokens_loopback_only",
                "controller_auth_disabled"
            );
        }
        ControlMode::Checked => {
            info!(
                controller_tokens = stores.token_count(Audience::Controller),
                policy_tokens = stores.token_count(Audience::Policy),
                "controller_auth_enabled"
            );
        }
    }
    if loopback_forced {
        tracing::warn!(addr = %snapshot_addr, "snapshot_listener_loopback_only");
    }
}

/// Outcome of a control-plane check (§9.1 decision table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlDecision {
    /// Auth is off (insecure or loopback mode): served, not counted.
    Open,
    /// `ok`.
    Pass,
    /// 401 `unauthorized\n`, `unauth`.
    Unauthorized,
    /// 403 `forbidden\n`, `forbidden`.
    Forbidden,
    /// 503 `token store unavailable\n`, `error`.
    Unavailable,
}

impl ControlDecision {
    /// The counter label, or `None` when not counted.
    pub fn result_label(self) -> Option<&'static str> {
        match self {
            ControlDecision::Open => None,
            ControlDecision::Pass => Some("ok"),
            ControlDecision::Unauthorized => Some("unauth"),
            ControlDecision::Forbidden => Some("forbidden"),
            ControlDecision::Unavailable => Some("error"),
        }
    }

    /// The HTTP rejection, or `None` when the request goes through.
    pub fn rejection(self) -> Option<(StatusCode, &'static str)> {
        match self {
            ControlDecision::Open | ControlDecision::Pass => None,
            ControlDecision::Unauthorized => Some((StatusCode::UNAUTHORIZED, "unauthorized\n")),
            ControlDecision::Forbidden => Some((StatusCode::FORBIDDEN, "forbidden\n")),
            ControlDecision::Unavailable => {
                Some((StatusCode::SERVICE_UNAVAILABLE, "token store unavailable\n"))
            }
        }
    }
}

/// The bearer token of an `Authorization` value: split at the first space, scheme `Bearer`
/// compared case-insensitively, token trimmed and non-empty.
pub fn bearer_token(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("Bearer") {
        return None;
    }
    let token = token.trim();
    (!token.is_empty()).then_some(token)
}

/// Authentication for the control plane and the producer RPCs.
pub struct Auth {
    stores: TokenStores,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("stores", &self.stores)
            .finish()
    }
}

impl Auth {
    pub fn new(stores: TokenStores, metrics: Arc<Metrics>) -> Self {
        Self { stores, metrics }
    }

    /// No token file and auth not disabled (loopback-only open control plane, open producers).
    pub fn open(metrics: Arc<Metrics>) -> Self {
        Self::new(TokenStores::none(), metrics)
    }

    pub fn control_mode(&self) -> ControlMode {
        self.stores.control_mode()
    }

    pub fn stores(&self) -> &TokenStores {
        &self.stores
    }

    /// Whether `ReportCacheState` / `PublishEvent` require a token.
    pub fn producer_auth_enabled(&self) -> bool {
        self.stores.producer.is_some()
    }

    /// The §9.1 decision for `route` given the request's `Authorization` header (not counted).
    pub fn decide(&self, route: AuthRoute, authorization: Option<&[u8]>) -> ControlDecision {
        if self.control_mode() != ControlMode::Checked {
            return ControlDecision::Open;
        }
        let (own, other) = match route {
            AuthRoute::Snapshot | AuthRoute::Probe => {
                (self.stores.controller.as_ref(), self.stores.policy.as_ref())
            }
            AuthRoute::Policy => (self.stores.policy.as_ref(), self.stores.controller.as_ref()),
        };
        // Row 1: no header, another scheme, or an empty token.
        let Some(token) = authorization.and_then(bearer_token) else {
            return ControlDecision::Unauthorized;
        };
        if let Some(s) = own {
            s.refresh();
        }
        if let Some(s) = other {
            s.refresh();
        }
        // Row 2: the route's audience has a file that currently holds no token.
        if own.is_some_and(TokenStore::is_empty) {
            return ControlDecision::Unavailable;
        }
        let presented = digest(token);
        // Both sets are always compared in full, whatever the outcome.
        let own_match = own.is_some_and(|s| s.contains(&presented));
        let other_match = other.is_some_and(|s| s.contains(&presented));
        if own_match {
            ControlDecision::Pass
        } else if other_match || (own.is_none() && other.is_some()) {
            ControlDecision::Forbidden
        } else {
            ControlDecision::Unauthorized
        }
    }

    /// Checks a control-plane request and counts the outcome. `Err` carries the rejection.
    pub fn check_control(
        &self,
        route: AuthRoute,
        headers: &HeaderMap,
    ) -> Result<(), (StatusCode, &'static str)> {
        let value = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        let decision = self.decide(route, value);
        if let Some(label) = decision.result_label() {
            self.metrics.observe_auth(route, label);
        }
        match decision.rejection() {
            Some(r) => Err(r),
            None => Ok(()),
        }
    }

    /// Producer check (§9.2) for `ReportCacheState` and `PublishEvent`, to run before any
    /// message is read. Without `--producer-token-file` every call passes, uncounted.
    pub fn check_producer(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<(), tonic::Status> {
        let Some(store) = self.stores.producer.as_ref() else {
            return Ok(());
        };
        let token = metadata
            .get("authorization")
            .and_then(|v| bearer_token(v.as_bytes()));
        let ok = match token {
            Some(token) => {
                store.refresh();
                store.contains(&digest(token))
            }
            None => false,
        };
        self.metrics.observe_producer_auth(ok);
        if ok {
            Ok(())
        } else {
            Err(tonic::Status::unauthenticated(PRODUCER_UNAUTHENTICATED))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("ic-auth-unit-{}-{tag}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
        fn file(&self, name: &str, text: &str) -> PathBuf {
            let p = self.0.join(name);
            let mut f = std::fs::File::create(&p).unwrap();
            f.write_all(text.as_bytes()).unwrap();
            p
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn auth(controller: Option<&str>, policy: Option<&str>, producer: Option<&str>) -> Auth {
        let dir = TempDir::new("auth");
        let cfg = AuthConfig {
            insecure_disable_auth: false,
            controller_token_file: controller.map(|t| dir.file("c", t)),
            policy_token_file: policy.map(|t| dir.file("p", t)),
            producer_token_file: producer.map(|t| dir.file("q", t)),
        };
        Auth::new(TokenStores::load(&cfg).unwrap(), Arc::new(Metrics::new()))
    }

    #[test]
    fn token_file_format() {
        assert_eq!(
            parse_tokens("  a \n\n# comment\n  # indented comment\nb\r\n\t\n"),
            vec!["a", "b"]
        );
        assert!(parse_tokens("# only\n\n").is_empty());
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token(b"Bearer abc"), Some("abc"));
        assert_eq!(bearer_token(b"bearer abc"), Some("abc"));
        assert_eq!(bearer_token(b"BEARER   abc  "), Some("abc"));
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Bearer"), None);
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b""), None);
        assert_eq!(bearer_token(b"Bearer\tabc"), None);
        assert_eq!(bearer_token(&[0xff, b' ', b'a']), None);
    }

    #[test]
    fn digest_comparison() {
        let a = digest("x");
        assert!(digests_equal(&a, &digest("x")));
        assert!(!digests_equal(&a, &digest("y")));
    }

    #[test]
    fn decision_table() {
        let a = auth(Some("c1\nshared\n"), Some("p1\nshared\n"), None);
        let d = |route, h: &str| a.decide(route, Some(h.as_bytes()));
        assert_eq!(
            a.decide(AuthRoute::Snapshot, None),
            ControlDecision::Unauthorized
        );
        assert_eq!(
            d(AuthRoute::Snapshot, "Basic c1"),
            ControlDecision::Unauthorized
        );
        assert_eq!(d(AuthRoute::Snapshot, "Bearer c1"), ControlDecision::Pass);
        assert_eq!(d(AuthRoute::Probe, "bearer c1"), ControlDecision::Pass);
        assert_eq!(d(AuthRoute::Policy, "Bearer p1"), ControlDecision::Pass);
        assert_eq!(
            d(AuthRoute::Policy, "Bearer c1"),
            ControlDecision::Forbidden
        );
        assert_eq!(
            d(AuthRoute::Snapshot, "Bearer p1"),
            ControlDecision::Forbidden
        );
        assert_eq!(
            d(AuthRoute::Snapshot, "Bearer shared"),
            ControlDecision::Pass
        );
        assert_eq!(d(AuthRoute::Policy, "Bearer shared"), ControlDecision::Pass);
        assert_eq!(
            d(AuthRoute::Snapshot, "Bearer nope"),
            ControlDecision::Unauthorized
        );
    }

    #[test]
    fn one_audience_configured() {
        // Only a policy file: any bearer on /snapshot is forbidden (the route's audience has no
        // file while the other does); /policy works as usual.
        let a = auth(None, Some("p1\n"), None);
        assert_eq!(a.control_mode(), ControlMode::Checked);
        let d = |route, h: &str| a.decide(route, Some(h.as_bytes()));
        assert_eq!(
            d(AuthRoute::Snapshot, "Bearer whatever"),
            ControlDecision::Forbidden
        );
        assert_eq!(
            d(AuthRoute::Snapshot, "Bearer p1"),
            ControlDecision::Forbidden
        );
        assert_eq!(
            a.decide(AuthRoute::Probe, None),
            ControlDecision::Unauthorized
        );
        assert_eq!(d(AuthRoute::Policy, "Bearer p1"), ControlDecision::Pass);
        assert_eq!(
            d(AuthRoute::Policy, "Bearer x"),
            ControlDecision::Unauthorized
        );
    }

    #[test]
    fn open_modes_are_not_checked() {
        let a = Auth::open(Arc::new(Metrics::new()));
        assert_eq!(a.control_mode(), ControlMode::LoopbackOpen);
        assert_eq!(a.decide(AuthRoute::Policy, None), ControlDecision::Open);
        let stores = TokenStores::load(&AuthConfig {
            insecure_disable_auth: true,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(stores.control_mode(), ControlMode::Insecure);
    }

    #[test]
    fn startup_rejects_bad_files_and_conflicts() {
        let dir = TempDir::new("startup");
        let empty = dir.file("empty", "# nothing\n\n");
        assert!(TokenStore::open(Audience::Controller, &empty).is_err());
        assert!(TokenStore::open(Audience::Policy, dir.0.join("missing")).is_err());
        let good = dir.file("good", "t\n");
        let err = TokenStores::load(&AuthConfig {
            insecure_disable_auth: true,
            policy_token_file: Some(good.clone()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("--insecure-disable-auth"));
        // The producer file is independent of the insecure flag.
        let stores = TokenStores::load(&AuthConfig {
            insecure_disable_auth: true,
            producer_token_file: Some(good),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(stores.token_count(Audience::Producer), 1);
    }

    #[test]
    fn reload_replaces_or_keeps_the_set() {
        let dir = TempDir::new("reload");
        let path = dir.file("tokens", "old\nnew-token\n");
        let store = TokenStore::open(Audience::Controller, &path).unwrap();
        assert_eq!(store.len(), 2);
        assert!(store.contains(&digest("old")));
        std::fs::write(&path, "new-token\n").unwrap();
        store.refresh_now();
        assert_eq!(store.len(), 1);
        assert!(!store.contains(&digest("old")));
        assert!(store.contains(&digest("new-token")));
        // Deleted: the last good set stays.
        std::fs::remove_file(&path).unwrap();
        store.refresh_now();
        assert!(store.contains(&digest("new-token")));
        // Emptied: an empty set (503 on the route).
        std::fs::write(&path, "# rotated out\n").unwrap();
        store.refresh_now();
        assert!(store.is_empty());
    }

    #[test]
    fn refresh_is_throttled() {
        let dir = TempDir::new("throttle");
        let path = dir.file("tokens", "a\n");
        let store = TokenStore::open(Audience::Producer, &path).unwrap();
        std::fs::write(&path, "bb\nc\n").unwrap();
        store.refresh(); // within a second of loading: not checked
        assert_eq!(store.len(), 1);
        store.reload.lock().last_check = Instant::now() - RELOAD_CHECK_INTERVAL;
        store.refresh();
        assert_eq!(store.len(), 2);
    }

    fn md(value: Option<&str>) -> tonic::metadata::MetadataMap {
        let mut m = tonic::metadata::MetadataMap::new();
        if let Some(v) = value {
            m.insert("authorization", v.parse().unwrap());
        }
        m
    }

    #[test]
    fn producer_check() {
        let a = auth(None, None, Some("prod\n"));
        assert!(a.producer_auth_enabled());
        assert!(a.check_producer(&md(Some("Bearer prod"))).is_ok());
        assert!(a.check_producer(&md(Some("bEaReR  prod "))).is_ok());
        for bad in [
            None,
            Some("Bearer nope"),
            Some("Basic prod"),
            Some("Bearer "),
        ] {
            let err = a.check_producer(&md(bad)).unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unauthenticated);
            assert_eq!(err.message(), PRODUCER_UNAUTHENTICATED);
        }
        let text =
            crate::metrics::render_text(&a.metrics.gather(&inferencecache_engine::Index::new(
                Default::default(),
                Arc::new(inferencecache_engine::DefaultResolvers),
                Arc::new(inferencecache_engine::SystemClock),
            )));
        assert!(
            text.contains("inferencecache_producer_auth_total{result=\"ok\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("inferencecache_producer_auth_total{result=\"unauth\"} 4"),
            "{text}"
        );
    }

    #[test]
    fn producer_check_empty_set_rejects_and_no_file_is_open() {
        let dir = TempDir::new("producer");
        let path = dir.file("tokens", "prod\n");
        let a = Auth::new(
            TokenStores::load(&AuthConfig {
                producer_token_file: Some(path.clone()),
                ..Default::default()
            })
            .unwrap(),
            Arc::new(Metrics::new()),
        );
        std::fs::write(&path, "\n").unwrap();
        a.stores.producer.as_ref().unwrap().refresh_now();
        assert!(a.check_producer(&md(Some("Bearer prod"))).is_err());
        let open = Auth::open(Arc::new(Metrics::new()));
        assert!(!open.producer_auth_enabled());
        assert!(open.check_producer(&md(None)).is_ok());
    }
}
