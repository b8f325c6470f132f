//! The hello: the first frame on every new connection between two ranks, which says who
//! connects (magic, protocol version, rank, job size, the job's secret; over TCP its host and
//! listening port) and is acknowledged with the listener's rank.

use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::{ct_eq, recv_frame, send_frame, FrameIo, UniqueId};
use crate::error::{CommError, Result};
use crate::wire::{Reader, Tag, Writer};

const MAGIC: &[u8; 8] = b"FLAGCXv1";
/// The version of the frames and shared-memory layouts ranks exchange, sent in every hello:
/// ranks of builds that disagree refuse each other there, naming both versions, instead of
/// misreading a later frame. Bumped with every such change (2: the staged ring's split in the
/// channel descriptor; 3: the reduction types in the peer information).
pub const PROTOCOL_VERSION: u32 = 3;

/// A hello's fields, as a peer's bytes give them ([`Hello::decode`]); the checks against this
/// job (version, secret, job size) are the receiver's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The protocol version the connector speaks ([`PROTOCOL_VERSION`] for this build).
    pub version: u32,
    /// The connector's rank.
    pub rank: u32,
    /// The job size the connector was started with.
    pub nranks: u32,
    /// The job's secret, as the connector holds it.
    pub secret: Vec<u8>,
    /// Over TCP: the connector's host and listening port.
    pub place: Option<(String, u16)>,
}

impl Hello {
    /// The frame payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.bytes(MAGIC)
            .u32(self.version)
            .u32(self.rank)
            .u32(self.nranks)
            .bytes(&self.secret);
        if let Some((host, port)) = &self.place {
            w.str(host).u32(*port as u32);
        }
        w.finish()
    }

    /// Decodes a hello payload (`tcp`: it carries the place): a typed error for anything
    /// malformed, never a panic.
    pub fn decode(payload: &[u8], tcp: bool) -> Result<Hello> {
        let mut r = Reader::new(payload, "hello");
        let magic = r.bytes()?;
        if magic != MAGIC {
            return Err(CommError::Bootstrap(
                "not a flagcx hello (wrong magic)".into(),
            ));
        }
        let version = r.u32()?;
        let rank = r.u32()?;
        let nranks = r.u32()?;
        let secret = r.bytes()?.to_vec();
        let place = if tcp {
            let host = r.str()?;
            let port = u16::try_from(r.u32()?)
                .map_err(|_| CommError::Bootstrap(format!("rank {rank} sent a bad port")))?;
            Some((host, port))
        } else {
            None
        };
        r.end()?;
        Ok(Hello {
            version,
            rank,
            nranks,
            secret,
            place,
        })
    }
}

/// Presents this rank to rank `q` on a fresh socket (over TCP with this rank's host and the
/// port it listens on) and waits for the acknowledgement.
pub(super) fn say_hello<S: FrameIo + SetReadTimeout>(
    s: &S,
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    q: usize,
    tcp: Option<(&str, u16)>,
    deadline: Instant,
) -> Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    s.read_timeout(left)
        .map_err(|e| CommError::io("socket timeout", e))?;
    let hello = Hello {
        version: PROTOCOL_VERSION,
        rank: rank as u32,
        nranks: nranks as u32,
        secret: id.secret.to_vec(),
        place: tcp.map(|(h, p)| (h.to_string(), p)),
    };
    send_frame(s, Tag::Hello, &hello.encode(), &[])?;
    let (tag, payload, _) = recv_frame(s)
        .map_err(|e| CommError::Bootstrap(format!("rank {q} did not accept rank {rank}: {e}")))?;
    let mut r = Reader::new(&payload, "hello ack");
    if tag != Tag::HelloAck || r.u32()? as usize != q {
        return Err(CommError::Bootstrap(format!(
            "rank {q} answered with a bad acknowledgement"
        )));
    }
    Ok(())
}

/// Sockets whose read timeout can be set.
pub(super) trait SetReadTimeout {
    fn read_timeout(&self, t: Duration) -> std::io::Result<()>;
}

impl SetReadTimeout for UnixStream {
    fn read_timeout(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))
    }
}

impl SetReadTimeout for TcpStream {
    fn read_timeout(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))
    }
}

/// Reads and checks a hello: magic, version, job size and secret; over TCP also the
/// connector's host and listening port. Acknowledges it. Returns the connector's rank.
pub(super) fn take_hello<S: FrameIo + SetReadTimeout>(
    s: &S,
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    tcp: bool,
) -> Result<(usize, Option<(String, u16)>)> {
    s.read_timeout(Duration::from_secs(2))
        .map_err(|e| CommError::io("socket timeout", e))?;
    let (tag, payload, _) = recv_frame(s)?;
    if tag != Tag::Hello {
        return Err(CommError::Bootstrap(format!("expected hello, got {tag:?}")));
    }
    let Hello {
        version,
        rank: q,
        nranks: n,
        secret,
        place,
    } = Hello::decode(&payload, tcp)?;
    let (q, n) = (q as usize, n as usize);
    if version != PROTOCOL_VERSION {
        return Err(CommError::Bootstrap(format!(
            "rank {q} speaks protocol version {version}, this rank {PROTOCOL_VERSION}: are all \
             ranks the same flagcx build?"
        )));
    }
    if !ct_eq(&secret, &id.secret) {
        return Err(CommError::Bootstrap(format!(
            "rank {q} presented a wrong secret"
        )));
    }
    if n != nranks || q >= nranks {
        return Err(CommError::Bootstrap(format!(
            "peer claims rank {q} of {n}, this job has {nranks} ranks"
        )));
    }
    send_frame(
        s,
        Tag::HelloAck,
        &Writer::new().u32(rank as u32).finish(),
        &[],
    )?;
    Ok((q, place))
}
