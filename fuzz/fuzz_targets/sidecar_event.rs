#![no_main]
//! cargo-fuzz target; the body and its checks are in `inferencecache_fuzz_harness::sidecar_event`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| inferencecache_fuzz_harness::sidecar_event(data));
