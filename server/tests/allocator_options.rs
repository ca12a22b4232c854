//! The server's mimalloc settings (`server/src/allocator.rs`): the purge delay's option number
//! names the option it means in the vendored mimalloc, the server's default applies, and an
//! operator's `MIMALLOC_PURGE_DELAY` wins over it.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use inferencecache_server::allocator::{PURGE_DELAY_MS, purge_delay_ms, set_purge_delay};
use std::process::Command;

/// Set in the child process that checks the operator's override.
const CHILD_MARK: &str = "INFERENCECACHE_ALLOCATOR_OPTIONS_CHILD";
const OPERATOR_DELAY_MS: std::ffi::c_long = 250;

#[test]
fn purge_delay_defaults_to_the_servers_and_yields_to_the_environment() {
    if std::env::var_os(CHILD_MARK).is_some() {
        // The child: mimalloc read MIMALLOC_PURGE_DELAY at start; the server's default must
        // not replace it.
        assert_eq!(
            purge_delay_ms(),
            OPERATOR_DELAY_MS,
            "the environment's delay at start"
        );
        set_purge_delay();
        assert_eq!(
            purge_delay_ms(),
            OPERATOR_DELAY_MS,
            "the operator's delay kept"
        );
        return;
    }
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // mimalloc v3's documented default for `mi_option_purge_delay`: reading it through the
        // server's option number shows the number names that option.
        assert_eq!(purge_delay_ms(), 1_000, "mimalloc v3's default purge delay");
        set_purge_delay();
        assert_eq!(
            purge_delay_ms(),
            PURGE_DELAY_MS,
            "the server's default applied"
        );
    } else {
        println!("MIMALLOC_PURGE_DELAY is set here: the default's check runs in the child only");
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let status = Command::new(exe)
        .args([
            "--exact",
            "purge_delay_defaults_to_the_servers_and_yields_to_the_environment",
            "--nocapture",
        ])
        .env(CHILD_MARK, "1")
        .env("MIMALLOC_PURGE_DELAY", OPERATOR_DELAY_MS.to_string())
        .status()
        .expect("the test binary runs as a child");
    assert!(status.success(), "the child's checks: {status}");
}
