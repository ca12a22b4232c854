//! `examples/inferencecache.toml` and `docs/configuration.md` stay true.
//!
//! - The example file loads, and a server configured with it has exactly the settings of a
//!   server given no file (every value in it is the built-in default).
//! - It sets every key that has a default; its commented-out namespace and tenant examples parse
//!   once uncommented.
//! - Every command-line flag is documented in `docs/configuration.md`.

use clap::CommandFactory;
use inferencecache_server::config::{Cli, parse_command_line};
use inferencecache_server::config_file::ConfigFile;
use inferencecache_server::policy::Policy;
use std::path::PathBuf;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn example_path() -> PathBuf {
    repo().join("examples/inferencecache.toml")
}

fn cli(args: &[&str]) -> Cli {
    let mut argv = vec!["inferencecache-server".into()];
    argv.extend(args.iter().map(|a| std::ffi::OsString::from(*a)));
    parse_command_line(argv).unwrap_or_else(|code| panic!("{args:?} refused: {code:?}"))
}

#[test]
fn the_example_holds_exactly_the_built_in_defaults() {
    let path = example_path();
    let path = path.to_str().unwrap();
    let mut with_file = cli(&["--config", path]);
    assert_eq!(with_file.config.as_deref(), Some(path));
    with_file.config = None;
    // Cli has no PartialEq: its Debug form lists every field and value.
    assert_eq!(format!("{with_file:#?}"), format!("{:#?}", cli(&[])));
    // The file's [policy.default] is the built-in "no policy" row.
    let file = ConfigFile::load(&example_path()).unwrap();
    let layer = file.policy_layer().unwrap();
    assert_eq!(**layer.default.as_ref().unwrap(), Policy::NONE);
    assert!(layer.namespaces.is_empty() && layer.quotas.is_empty());
}

#[test]
fn the_example_sets_every_key_that_has_a_default() {
    let f = ConfigFile::load(&example_path()).unwrap();
    let set = [
        ("grpc_bind_address", f.grpc_bind_address.is_some()),
        ("http_bind_address", f.http_bind_address.is_some()),
        ("snapshot_bind_address", f.snapshot_bind_address.is_some()),
        ("engine_block_size", f.engine_block_size.is_some()),
        ("log_format", f.log_format.is_some()),
        ("log_level", f.log_level.is_some()),
        ("insecure_disable_auth", f.insecure_disable_auth.is_some()),
        ("index.max_entries", f.index.max_entries.is_some()),
        ("index.ttl", f.index.ttl.is_some()),
        ("index.sweep_interval", f.index.sweep_interval.is_some()),
        (
            "index.hot_access_threshold",
            f.index.hot_access_threshold.is_some(),
        ),
        ("streams.buffer_events", f.streams.buffer_events.is_some()),
        (
            "streams.max_subscribers",
            f.streams.max_subscribers.is_some(),
        ),
        (
            "limits.max_chain_length",
            f.limits.max_chain_length.is_some(),
        ),
        ("limits.max_hash_bytes", f.limits.max_hash_bytes.is_some()),
        ("limits.max_id_bytes", f.limits.max_id_bytes.is_some()),
        (
            "limits.max_prefixes_per_update",
            f.limits.max_prefixes_per_update.is_some(),
        ),
        (
            "limits.max_message_bytes",
            f.limits.max_message_bytes.is_some(),
        ),
        (
            "limits.producer_max_blocks_per_sec",
            f.limits.producer_max_blocks_per_sec.is_some(),
        ),
        (
            "state.checkpoint_interval",
            f.state.checkpoint_interval.is_some(),
        ),
    ];
    let missing: Vec<&str> = set.iter().filter(|(_, s)| !s).map(|(k, _)| *k).collect();
    assert!(
        missing.is_empty(),
        "keys missing from the example: {missing:?}"
    );
    let default = f.policy.default.as_ref().expect("[policy.default]");
    assert!(
        default.eviction_ttl.is_some()
            && default.minimum_prefix_tokens.is_some()
            && default.minimum_matched_tokens.is_some()
            && default.routing_floor_score.is_some()
            && default.lookup_timeout_ms.is_some()
            && default.affinity_routing.is_some()
            && default.eviction.is_some(),
        "{default:?}"
    );
    let strategy = default.strategy.as_ref().expect("strategy");
    assert!(
        strategy.enable_chain_matching.is_some()
            && strategy.require_chain.is_some()
            && strategy.enable_tenant_hot.is_some()
    );
}

#[test]
fn the_commented_examples_parse_when_uncommented() {
    let text = std::fs::read_to_string(example_path()).unwrap();
    // Uncomment the trailing example block (from the [[policy.namespaces]] line on).
    let start = text
        .find("\n# [[policy.namespaces]]\n")
        .expect("namespace example")
        + 1;
    let uncommented: String = text[start..]
        .lines()
        .map(|l| l.strip_prefix("# ").or(l.strip_prefix("#")).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let file = ConfigFile::parse(&format!("{}{uncommented}\n", &text[..start])).unwrap();
    let layer = file.policy_layer().unwrap();
    let a = &layer.namespaces["team-a"];
    assert_eq!(a.eviction_ttl_ns, 600_000_000_000);
    assert_eq!(a.minimum_matched_tokens, 32);
    assert!(a.require_chain);
    assert_eq!(layer.quotas["tenant-a"], 100_000);
    // The commented TLS and auth lines name real keys too.
    let tls_auth: String = text
        .lines()
        .filter(|l| l.starts_with("# ") && l.contains("_file = "))
        .map(|l| &l[2..])
        .collect::<Vec<_>>()
        .join("\n");
    for line in tls_auth.lines() {
        let key = line.split('=').next().unwrap().trim();
        let section = if ["cert_file", "key_file", "client_ca_file"].contains(&key) {
            "tls"
        } else {
            "auth"
        };
        let one = format!("[{section}]\n{line}\n");
        ConfigFile::parse(&one).unwrap_or_else(|e| panic!("{one}: {e:#}"));
    }
}

#[test]
fn every_flag_is_documented() {
    let doc = std::fs::read_to_string(repo().join("docs/configuration.md")).unwrap();
    let command = Cli::command();
    let mut missing = Vec::new();
    for arg in command.get_arguments() {
        if arg.is_hide_set() {
            continue;
        }
        if let Some(long) = arg.get_long()
            && !doc.contains(&format!("`--{long}`"))
        {
            missing.push(long.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "flags not in docs/configuration.md: {missing:?}"
    );
}
