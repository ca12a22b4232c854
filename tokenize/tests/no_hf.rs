//! Behaviour with the `hf` feature off: same API, nothing loads, every lookup is unknown.

#![cfg(not(feature = "hf"))]

mod common;

use inferencecache_tokenize::{LoadStats, TokenizeError, Tokenizers};

#[test]
fn compiled_out_loads_nothing() {
    let root = tempfile::tempdir().unwrap();
    common::write_model(root.path(), "org/name", None);
    let t = Tokenizers::load(root.path());
    assert!(t.is_empty());
    assert_eq!(t.stats(), LoadStats::default());
    assert_eq!(
        t.encode_chat("org/name", "hello"),
        Err(TokenizeError::UnknownModel)
    );
    assert_eq!(
        t.encode_chat("../x", "hello"),
        Err(TokenizeError::UnsafeModelId)
    );
}
