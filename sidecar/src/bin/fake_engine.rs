//! `inferencecache-fake-engine`: publishes a chained BlockStored batch over ZMQ PUB, like an
//! engine, and prints the prefix hashes a lookup should find (spec `sidecar.md` §10).

use bytes::Bytes;
use clap::Parser;
use inferencecache_sidecar::config::{duration_or_default, normalize_args};
use inferencecache_sidecar::fake_engine::{FakeCli, Plan};
use std::io::Write;
use std::time::Duration;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = FakeCli::parse_from(normalize_args(std::env::args_os()));
    let plan = match Plan::new(
        cli.block_size,
        cli.num_blocks,
        cli.events,
        cli.start_token,
        cli.omit_token_ids,
    ) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("inferencecache-fake-engine: {e}");
            std::process::exit(2);
        }
    };
    let interval = match duration_or_default(&cli.interval, Duration::from_millis(500)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("inferencecache-fake-engine: --interval: {e}");
            std::process::exit(2);
        }
    };
    let mut sock = PubSocket::new();
    let endpoint = match sock.bind(&cli.bind).await {
        Ok(ep) => ep,
        Err(e) => {
            eprintln!("inferencecache-fake-engine: bind {}: {e}", cli.bind);
            std::process::exit(1);
        }
    };
    let payload = Bytes::from(plan.payload());
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "LISTENING {endpoint}");
        let _ = writeln!(
            out,
            "PUBLISHING topic={:?} blocks={} events={} block_size={} start_token={}",
            cli.topic, plan.num_blocks, plan.events, plan.block_size, plan.start_token
        );
        for line in plan.expect_lines() {
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
    }
    let topic = Bytes::from(cli.topic.clone().into_bytes());
    let mut seq: u64 = 0;
    let mut ticker = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = ticker.tick() => {
                let frames = vec![
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload.clone(),
                ];
                seq += 1;
                if let Ok(msg) = ZmqMessage::try_from(frames)
                    && let Err(e) = sock.send(msg).await
                {
                    eprintln!("inferencecache-fake-engine: send: {e}");
                }
            }
        }
    }
}
