//! The TCP part of bootstrap, for jobs over several hosts: meeting at the root, and the
//! connections between ranks on different hosts (see the parent module).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{recv_frame, say_hello, send_frame, take_hello, UniqueId};
use crate::error::{CommError, Result};
use crate::wire::{Reader, Tag, Writer};

/// The machine's identity: hostname, kernel boot id and network namespace.
pub fn host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    // The network namespace too: ranks in different namespaces cannot reach each other's
    // abstract sockets, so they are on different hosts as far as the job goes (and that is how
    // the network transport is tested on one machine).
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(
        "{}/{}/{netns}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// Checks a peer connecting over TCP ([`take_hello`]; no uid to check across hosts).
pub(super) fn admit_tcp(
    s: TcpStream,
    id: &UniqueId,
    rank: usize,
    nranks: usize,
) -> Result<(usize, TcpStream, String, u16)> {
    s.set_nonblocking(false)
        .and_then(|()| s.set_nodelay(true))
        .map_err(|e| CommError::io("socket options", e))?;
    let (q, place) = take_hello(&s, id, rank, nranks, true)?;
    let (host, port) = place.expect("asked for over TCP");
    Ok((q, s, host, port))
}

/// Connects over TCP to `addr` (retrying while nobody listens yet, until `deadline`).
fn tcp_dial(
    rank: usize,
    q: usize,
    addr: std::net::SocketAddr,
    deadline: Instant,
) -> Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(10))) {
            Ok(s) => {
                s.set_nodelay(true)
                    .map_err(|e| CommError::io("TCP_NODELAY", e))?;
                return Ok(s);
            }
            Err(e)
                if Instant::now() < deadline
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut
                    ) =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                return Err(CommError::Bootstrap(format!(
                    "rank {rank} could not reach rank {q} at {addr}: {e}"
                )))
            }
        }
    }
}

/// Connects to rank `q` on another host and presents this rank.
pub(super) fn tcp_connect(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    q: usize,
    addr: std::net::SocketAddr,
    deadline: Instant,
) -> Result<TcpStream> {
    let s = tcp_dial(rank, q, addr, deadline)?;
    let host = host_id();
    say_hello(&s, id, rank, nranks, q, Some((&host, 0)), deadline)?;
    Ok(s)
}

/// Every rank's host and TCP address, as the root hands them out.
pub type Table = Vec<(String, std::net::SocketAddr)>;

/// The table frame's payload.
pub fn encode_table(table: &Table) -> Vec<u8> {
    let mut w = Writer::new();
    for (h, a) in table {
        w.str(h).str(&a.to_string());
    }
    w.finish()
}

/// Decodes the root's table of `nranks` entries: a typed error for anything malformed (a
/// short or long frame, an address that does not parse), never a panic.
pub fn decode_table(payload: &[u8], nranks: usize) -> Result<Table> {
    let mut r = Reader::new(payload, "table");
    // Every entry takes at least two length words: a frame cannot hold more.
    let mut table = Table::with_capacity(nranks.min(payload.len() / 8));
    for _ in 0..nranks {
        let h = r.str()?;
        let a = r.str()?;
        let a = a
            .parse()
            .map_err(|_| CommError::Protocol(format!("bad address {a:?} in the table")))?;
        table.push((h, a));
    }
    r.end()?;
    Ok(table)
}

/// The TCP phase: binds this rank's listener (the root's address for rank 0, any port
/// otherwise), then rank 0 collects every rank's hello and sends each the table; the others
/// present themselves to it and receive the table. Returns the listener, the table and the
/// links made with the root (indexed by peer).
pub(super) fn meet_at_root(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    root: std::net::SocketAddr,
    deadline: Instant,
) -> Result<(TcpListener, Table, Vec<Option<TcpStream>>)> {
    let bind = if rank == 0 {
        root
    } else {
        let any = match root.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        std::net::SocketAddr::new(any, 0)
    };
    let listener = TcpListener::bind(bind)
        .map_err(|e| CommError::Bootstrap(format!("rank {rank} cannot listen on {bind}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("listener nonblocking", e))?;
    let port = listener
        .local_addr()
        .map_err(|e| CommError::io("listener address", e))?
        .port();
    let host = host_id();
    let mut links: Vec<Option<TcpStream>> = (0..nranks).map(|_| None).collect();
    if rank != 0 {
        let s = tcp_dial(rank, 0, root, deadline)?;
        say_hello(&s, id, rank, nranks, 0, Some((&host, port)), deadline)?;
        let (tag, payload, _) = recv_frame(&s)?;
        if tag != Tag::Table {
            return Err(CommError::Bootstrap(format!(
                "the root sent {tag:?} instead of the table"
            )));
        }
        let table = decode_table(&payload, nranks)?;
        links[0] = Some(s);
        return Ok((listener, table, links));
    }
    let mut table: Vec<Option<(String, std::net::SocketAddr)>> = vec![None; nranks];
    table[0] = Some((host, root));
    let mut missing = nranks - 1;
    while missing > 0 {
        match listener.accept() {
            Ok((s, from)) => match admit_tcp(s, id, 0, nranks) {
                Ok((q, s, h, p)) if q > 0 && table[q].is_none() => {
                    table[q] = Some((h, std::net::SocketAddr::new(from.ip(), p)));
                    links[q] = Some(s);
                    missing -= 1;
                }
                Ok((q, ..)) => tracing::warn!("root refused a duplicate hello from rank {q}"),
                Err(e) => tracing::warn!("root refused a bootstrap connection from {from}: {e}"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let absent: Vec<usize> = (1..nranks).filter(|&q| table[q].is_none()).collect();
                    return Err(CommError::Bootstrap(format!(
                        "root: ranks {absent:?} did not reach {root} in time"
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(CommError::io("accept", e)),
        }
    }
    let table: Table = table.into_iter().flatten().collect();
    let bytes = encode_table(&table);
    for s in links.iter().flatten() {
        send_frame(s, Tag::Table, &bytes, &[])?;
    }
    Ok((listener, table, links))
}
