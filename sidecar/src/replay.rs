//! Client of an engine's replay socket (vLLM and SGLang `replay_endpoint`).
//!
//! The engine binds a ZMQ ROUTER. A request is `[empty delimiter, start seq (u64 big-endian)]`
//! from a DEALER; the engine answers every buffered batch with `seq >= start` as
//! `[empty, topic, seq, payload]` — the live stream's frames — and ends with
//! `[empty, empty, seq = -1, empty]`. The buffer holds the last `buffer_steps` batches, so the
//! first answered sequence may be later than the one asked for: the caller checks.

use bytes::Bytes;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How long the engine may stay silent while answering (it polls its ROUTER between batches).
pub const REPLAY_IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Most batches one answer may carry (engines default to a 10,000-batch buffer).
pub const MAX_REPLAY_BATCHES: usize = 200_000;
/// The end marker's sequence frame (-1 as a signed 64-bit integer).
pub const END_SEQUENCE: u64 = u64::MAX;

/// One replayed batch, as it was published live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// Topic frame.
    pub topic: Bytes,
    /// Sequence number.
    pub seq: u64,
    /// The msgpack batch.
    pub payload: Bytes,
}

/// Asks `endpoint` for every buffered batch from `start` on; the batches in the engine's order.
pub async fn request(endpoint: &str, start: u64) -> Result<Vec<Replayed>, String> {
    let mut socket = DealerSocket::new();
    let connected = tokio::time::timeout(REPLAY_IDLE_TIMEOUT, socket.connect(endpoint)).await;
    match connected {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("connect {endpoint}: {e}")),
        Err(_) => return Err(format!("connect {endpoint}: timed out")),
    }
    let result = exchange(&mut socket, start).await;
    drop(socket.close().await);
    result
}

async fn exchange(socket: &mut DealerSocket, start: u64) -> Result<Vec<Replayed>, String> {
    let ask = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .map_err(|e| format!("build request: {e}"))?;
    socket
        .send(ask)
        .await
        .map_err(|e| format!("send request: {e}"))?;
    let mut out = Vec::new();
    loop {
        let message = match tokio::time::timeout(REPLAY_IDLE_TIMEOUT, socket.recv()).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(format!("receive: {e}")),
            Err(_) => {
                return Err(format!(
                    "no end marker after {} batches within {REPLAY_IDLE_TIMEOUT:?}",
                    out.len()
                ));
            }
        };
        match parse_frame(message.into_vec())? {
            None => return Ok(out),
            Some(batch) => {
                if out.len() >= MAX_REPLAY_BATCHES {
                    return Err(format!("answer exceeds {MAX_REPLAY_BATCHES} batches"));
                }
                out.push(batch);
            }
        }
    }
}

/// One answer frame: a batch, or `None` for the end marker.
pub fn parse_frame(mut frames: Vec<Bytes>) -> Result<Option<Replayed>, String> {
    // The ROUTER's empty delimiter survives to the DEALER.
    if frames.first().is_some_and(Bytes::is_empty) && frames.len() == 4 {
        frames.remove(0);
    }
    let [topic, seq, payload] = <[Bytes; 3]>::try_from(frames).map_err(|f| {
        format!(
            "replay answer has {} frames, want 3 after the delimiter",
            f.len()
        )
    })?;
    let seq: [u8; 8] = seq[..]
        .try_into()
        .map_err(|_| format!("replay sequence frame has {} bytes", seq.len()))?;
    let seq = u64::from_be_bytes(seq);
    if seq == END_SEQUENCE {
        return Ok(None);
    }
    Ok(Some(Replayed {
        topic,
        seq,
        payload,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames() {
        let b = |x: &[u8]| Bytes::copy_from_slice(x);
        let got = parse_frame(vec![b(b""), b(b""), b(&7u64.to_be_bytes()), b(b"p")]).unwrap();
        assert_eq!(
            got,
            Some(Replayed {
                topic: b(b""),
                seq: 7,
                payload: b(b"p")
            })
        );
        let end = parse_frame(vec![b(b""), b(b""), b(&(-1i64).to_be_bytes()), b(b"")]).unwrap();
        assert_eq!(end, None);
        assert!(parse_frame(vec![b(b""), b(b"t"), b(b"short"), b(b"p")]).is_err());
        assert!(parse_frame(vec![b(b"x")]).is_err());
    }
}
