//! Bootstrap: the ranks of one job find each other and form a full mesh of Unix-domain sockets.
//!
//! Every rank listens on an abstract-namespace socket named after the job's [`UniqueId`] and its
//! rank — abstract names leave no file behind when a process dies. Rank `r` connects to every
//! lower rank and accepts every higher one. Admission is two-sided: the connector checks that the
//! listener runs as our uid (`SO_PEERCRED`) *before* it reveals the secret, and the listener
//! checks the connector's uid and the secret; anything else is logged and dropped without
//! disturbing the job. Over the mesh go tagged frames ([`crate::wire`]) with file descriptors
//! (`SCM_RIGHTS`), an all-gather and a barrier.
//!
//! Across hosts (the id carries a root address, [`UniqueId::with_root`]) every rank first
//! reaches the root (rank 0) over TCP and presents the secret, its host and the port it listens
//! on; the root answers each with the table of every rank's host and address. Then pairs on one
//! host (same [`host_id`]: machine and network namespace) connect over abstract
//! Unix sockets as above — they keep descriptor passing and the intra-node transports — and
//! pairs on different hosts over TCP, with the same admission checks except the uid (which
//! only a local socket can tell).

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::socket::{
    getsockopt, recvmsg, sendmsg, sockopt::PeerCredentials, ControlMessage, ControlMessageOwned,
    MsgFlags,
};

use crate::error::{CommError, Result};
use crate::wire::{self, Tag, HEADER_LEN};

mod hello;
mod tcp;
use hello::{say_hello, take_hello};
pub use hello::{Hello, PROTOCOL_VERSION};
use tcp::{admit_tcp, meet_at_root, tcp_connect};
pub use tcp::{decode_table, encode_table, host_id, Table};

const MAX_FDS_PER_FRAME: usize = 16;

/// A job's identity: a public name (which socket addresses derive from), a secret that peers
/// must present, and for jobs over several hosts the root's TCP address. Its text form,
/// `fx1-<32 hex>-<32 hex>` or `fx1-<32 hex>-<32 hex>@<host:port>`, is what
/// `FLAGCX_UNIQUE_ID` carries.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    name: [u8; 16],
    secret: [u8; 16],
    root: Option<std::net::SocketAddr>,
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        write!(f, "UniqueId({})", hex(&self.name))
    }
}

impl UniqueId {
    /// A fresh id from the OS random source.
    pub fn random() -> Result<Self> {
        let mut b = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut b))
            .map_err(|e| CommError::io("read /dev/urandom", e))?;
        let mut id = UniqueId {
            root: None,
            name: [0; 16],
            secret: [0; 16],
        };
        id.name.copy_from_slice(&b[..16]);
        id.secret.copy_from_slice(&b[16..]);
        Ok(id)
    }

    /// An id derived from a job identifier that every rank sees (e.g. a launcher's run id).
    ///
    /// Anyone who can read the job identifier can derive the secret, so admission then rests on
    /// the same-uid check; prefer [`UniqueId::random`] passed through `FLAGCX_UNIQUE_ID`.
    pub fn derived(job: &str) -> Self {
        UniqueId {
            name: fnv128(&format!("flagcx-name:{job}")),
            secret: fnv128(&format!("flagcx-secret:{job}")),
            root: None,
        }
    }

    /// The same job over several hosts: rank 0 listens on `root` (an address of its host that
    /// every rank can reach) and the ranks meet there over TCP.
    pub fn with_root(mut self, root: std::net::SocketAddr) -> Self {
        self.root = Some(root);
        self
    }

    /// The root's address, where the job spans hosts.
    pub fn root(&self) -> Option<std::net::SocketAddr> {
        self.root
    }

    /// The public part, as hex (used in socket names and logs).
    pub fn name_hex(&self) -> String {
        hex(&self.name)
    }
}

impl std::fmt::Display for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fx1-{}-{}", hex(&self.name), hex(&self.secret))?;
        match self.root {
            Some(a) => write!(f, "@{a}"),
            None => Ok(()),
        }
    }
}

impl std::str::FromStr for UniqueId {
    type Err = CommError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| CommError::config("FLAGCX_UNIQUE_ID", s, why.to_string());
        let (s_id, root) = match s.trim().split_once('@') {
            Some((i, a)) => (
                i,
                Some(
                    a.parse::<std::net::SocketAddr>()
                        .map_err(|_| bad("the part after @ is not an ip:port address"))?,
                ),
            ),
            None => (s.trim(), None),
        };
        let mut parts = s_id.split('-');
        if parts.next() != Some("fx1") {
            return Err(bad("expected fx1-<32 hex>-<32 hex>"));
        }
        let name = unhex16(parts.next().unwrap_or("")).ok_or_else(|| bad("bad name part"))?;
        let secret = unhex16(parts.next().unwrap_or("")).ok_or_else(|| bad("bad secret part"))?;
        if parts.next().is_some() {
            return Err(bad("trailing data"));
        }
        Ok(UniqueId { name, secret, root })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex16(s: &str) -> Option<[u8; 16]> {
    // Hex digits only: `u8::from_str_radix` alone would take "+f" as 15.
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// FNV-1a, 128-bit: stable across Rust versions, unlike `DefaultHasher`.
fn fnv128(s: &str) -> [u8; 16] {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in s.bytes() {
        h ^= b as u128;
        h = h.wrapping_mul(0x0000000001000000000000000000013B);
    }
    h.to_le_bytes()
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The abstract-namespace socket name rank `rank` of job `id` listens on (for diagnostics and
/// admission tests).
pub fn socket_name(id: &UniqueId, rank: usize) -> String {
    format!("flagcx-{}-{rank}", id.name_hex())
}

fn socket_addr(id: &UniqueId, rank: usize) -> Result<SocketAddr> {
    SocketAddr::from_abstract_name(socket_name(id, rank).as_bytes())
        .map_err(|e| CommError::io("socket name", e))
}

fn peer_uid(s: &UnixStream) -> Result<u32> {
    getsockopt(s, PeerCredentials)
        .map(|c| c.uid())
        .map_err(|e| CommError::io("SO_PEERCRED", e.into()))
}

fn my_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// One rank's socket to another: local (descriptors can pass) or TCP (another host).
#[derive(Debug)]
enum Link {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// What frames need of a socket.
trait FrameIo: AsRawFd {
    /// Whether descriptors can travel over it.
    fn passes_fds(&self) -> bool;
    fn write_all(&self, b: &[u8]) -> std::io::Result<()>;
    fn read_exact(&self, b: &mut [u8]) -> std::io::Result<()>;
}

impl FrameIo for UnixStream {
    fn passes_fds(&self) -> bool {
        true
    }
    fn write_all(&self, b: &[u8]) -> std::io::Result<()> {
        Write::write_all(&mut &*self, b)
    }
    fn read_exact(&self, b: &mut [u8]) -> std::io::Result<()> {
        Read::read_exact(&mut &*self, b)
    }
}

impl FrameIo for TcpStream {
    fn passes_fds(&self) -> bool {
        false
    }
    fn write_all(&self, b: &[u8]) -> std::io::Result<()> {
        Write::write_all(&mut &*self, b)
    }
    fn read_exact(&self, b: &mut [u8]) -> std::io::Result<()> {
        Read::read_exact(&mut &*self, b)
    }
}

impl AsRawFd for Link {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Link::Unix(s) => s.as_raw_fd(),
            Link::Tcp(s) => s.as_raw_fd(),
        }
    }
}

impl FrameIo for Link {
    fn passes_fds(&self) -> bool {
        matches!(self, Link::Unix(_))
    }
    fn write_all(&self, b: &[u8]) -> std::io::Result<()> {
        match self {
            Link::Unix(s) => FrameIo::write_all(s, b),
            Link::Tcp(s) => FrameIo::write_all(s, b),
        }
    }
    fn read_exact(&self, b: &mut [u8]) -> std::io::Result<()> {
        match self {
            Link::Unix(s) => FrameIo::read_exact(s, b),
            Link::Tcp(s) => FrameIo::read_exact(s, b),
        }
    }
}

impl Link {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()> {
        match self {
            Link::Unix(s) => s
                .set_read_timeout(Some(t))
                .and_then(|()| s.set_write_timeout(Some(t))),
            Link::Tcp(s) => s
                .set_read_timeout(Some(t))
                .and_then(|()| s.set_write_timeout(Some(t))),
        }
    }
}

/// The mesh of one job: a socket to every other rank.
#[derive(Debug)]
pub struct Bootstrap {
    rank: usize,
    nranks: usize,
    peers: Vec<Option<Mutex<Link>>>,
    /// Each link's descriptor, readable without its lock (a frame may be in flight).
    fds: Vec<Option<RawFd>>,
    timeout: Duration,
}

impl Bootstrap {
    /// Joins job `id` as `rank` of `nranks`, waiting up to `timeout` for the
    /// others.
    pub fn connect(rank: usize, nranks: usize, id: &UniqueId, timeout: Duration) -> Result<Self> {
        if nranks == 0 || rank >= nranks {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank} is not in 0..{nranks}"
            )));
        }
        let deadline = Instant::now() + timeout;
        let unix = UnixListener::bind_addr(&socket_addr(id, rank)?).map_err(|e| {
            CommError::Bootstrap(format!(
                "rank {rank} cannot listen (is another job using the same unique id?): {e}"
            ))
        })?;
        unix.set_nonblocking(true)
            .map_err(|e| CommError::io("listener nonblocking", e))?;
        let mut peers: Vec<Option<Link>> = (0..nranks).map(|_| None).collect();
        let mut tcp = None;
        // Which peers are on this host (all of them without a root).
        let mut local = vec![true; nranks];
        if let Some(root) = id.root {
            let (listener, table, root_links) = meet_at_root(id, rank, nranks, root, deadline)?;
            let host = host_id();
            for (q, (h, _)) in table.iter().enumerate() {
                local[q] = *h == host;
            }
            // Links to or from the root stay only between hosts.
            for (q, l) in root_links.into_iter().enumerate() {
                if !local[q] {
                    peers[q] = l.map(Link::Tcp);
                }
            }
            for q in (1..rank).filter(|&q| !local[q]) {
                let s = tcp_connect(id, rank, nranks, q, table[q].1, deadline)?;
                peers[q] = Some(Link::Tcp(s));
            }
            tcp = Some(listener);
        }
        for q in (0..rank).filter(|&q| local[q]) {
            peers[q] = Some(Link::Unix(connect_to(id, rank, nranks, q, deadline)?));
        }
        let mut missing = (rank + 1..nranks).filter(|&q| peers[q].is_none()).count();
        while missing > 0 {
            let mut took = false;
            let mut take = |got: Result<(usize, Link)>, via_tcp: bool| match got {
                Ok((q, s)) if q > rank && peers[q].is_none() && local[q] != via_tcp => {
                    peers[q] = Some(s);
                    missing -= 1;
                }
                Ok((q, _)) => tracing::warn!(
                    rank,
                    "refused a duplicate, misordered or misrouted hello from rank {q}"
                ),
                Err(e) => tracing::warn!(rank, "refused a bootstrap connection: {e}"),
            };
            match unix.accept() {
                Ok((s, _)) => {
                    took = true;
                    take(
                        admit(s, id, rank, nranks).map(|(q, s)| (q, Link::Unix(s))),
                        false,
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(CommError::io("accept", e)),
            }
            if let Some(l) = &tcp {
                match l.accept() {
                    Ok((s, _)) => {
                        took = true;
                        take(
                            admit_tcp(s, id, rank, nranks).map(|(q, s, ..)| (q, Link::Tcp(s))),
                            true,
                        );
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(CommError::io("accept", e)),
                }
            }
            if !took {
                if Instant::now() > deadline {
                    let absent: Vec<usize> =
                        (rank + 1..nranks).filter(|&q| peers[q].is_none()).collect();
                    return Err(CommError::Bootstrap(format!(
                        "rank {rank}: ranks {absent:?} did not connect within {} ms",
                        timeout.as_millis()
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // Every later exchange (peer information, channels, barriers) is bounded by the same
        // limit: a peer that stops answering (stopped, wedged) fails it with `Timeout`.
        for s in peers.iter().flatten() {
            s.set_timeouts(timeout)
                .map_err(|e| CommError::io("socket timeout", e))?;
        }
        Ok(Bootstrap {
            rank,
            nranks,
            fds: peers
                .iter()
                .map(|l| l.as_ref().map(|l| l.as_raw_fd()))
                .collect(),
            peers: peers.into_iter().map(|l| l.map(Mutex::new)).collect(),
            timeout,
        })
    }

    /// Whether the link to `peer` is a local socket (the peer is on this host).
    pub fn is_local(&self, peer: usize) -> bool {
        self.peer(peer)
            .map(|l| matches!(*l, Link::Unix(_)))
            .unwrap_or(false)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    fn peer(&self, peer: usize) -> Result<std::sync::MutexGuard<'_, Link>> {
        self.peers
            .get(peer)
            .and_then(|p| p.as_ref())
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
            .ok_or_else(|| CommError::InvalidArgument(format!("no bootstrap peer {peer}")))
    }

    /// The raw socket to `peer`, for readiness polling (peer-death detection). Never waits
    /// for a frame another thread is sending or receiving on the link.
    pub fn peer_fd(&self, peer: usize) -> Option<RawFd> {
        self.fds.get(peer).copied().flatten()
    }

    /// Sends a tagged frame, with file descriptors, to `peer`.
    pub fn send(
        &self,
        peer: usize,
        tag: Tag,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<()> {
        let s = self.peer(peer)?;
        send_frame(&*s, tag, payload, fds).map_err(|e| self.lost_or(peer, tag, e))
    }

    /// Receives the next frame from `peer`, which must carry `tag`.
    pub fn recv(&self, peer: usize, tag: Tag) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
        let s = self.peer(peer)?;
        let (got, payload, fds) = recv_frame(&*s).map_err(|e| self.lost_or(peer, tag, e))?;
        if got != tag {
            return Err(CommError::Protocol(format!(
                "expected a {tag:?} frame from rank {peer}, got {got:?}"
            )));
        }
        Ok((payload, fds))
    }

    /// Every rank's `mine`, indexed by rank.
    pub fn all_gather(&self, tag: Tag, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        // Payloads are small (socket buffers hold them), so sending to all first cannot block
        // on a peer that is itself sending.
        for q in (0..self.nranks).filter(|&q| q != self.rank) {
            self.send(q, tag, mine, &[])?;
        }
        let mut all = vec![Vec::new(); self.nranks];
        all[self.rank] = mine.to_vec();
        for (q, slot) in all.iter_mut().enumerate() {
            if q != self.rank {
                *slot = self.recv(q, tag)?.0;
            }
        }
        Ok(all)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.all_gather(Tag::Barrier, &[]).map(|_| ())
    }

    /// The time bootstrap waits for peers.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A socket error with `peer` while exchanging a `tag` frame, as the caller should see
    /// it: a closed socket is a lost peer, a read or write past the limit a timeout.
    fn lost_or(&self, peer: usize, tag: Tag, e: CommError) -> CommError {
        match e {
            CommError::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                CommError::Timeout {
                    ms: self.timeout.as_millis() as u64,
                    peer: Some(peer),
                    what: format!("bootstrap: rank {peer} did not exchange its {tag:?} frame"),
                }
            }
            other => lost_or(peer, other),
        }
    }
}

fn lost_or(peer: usize, e: CommError) -> CommError {
    match e {
        CommError::Io { source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            CommError::PeerLost {
                peer,
                reason: format!("bootstrap socket closed ({source})"),
            }
        }
        other => other,
    }
}

fn connect_to(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    q: usize,
    deadline: Instant,
) -> Result<UnixStream> {
    let addr = socket_addr(id, q)?;
    let s = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => break s,
            Err(e)
                if Instant::now() < deadline
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                    ) =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                return Err(CommError::Bootstrap(format!(
                    "rank {rank} could not reach rank {q}: {e}"
                )))
            }
        }
    };
    // Only reveal the secret to a listener that runs as us.
    let uid = peer_uid(&s)?;
    if uid != my_uid() {
        return Err(CommError::Bootstrap(format!(
            "rank {q}'s socket belongs to uid {uid}, not ours ({}); refusing to send the secret",
            my_uid()
        )));
    }
    say_hello(&s, id, rank, nranks, q, None, deadline)?;
    Ok(s)
}

/// Checks a connecting local peer: same uid, then [`take_hello`].
fn admit(s: UnixStream, id: &UniqueId, rank: usize, nranks: usize) -> Result<(usize, UnixStream)> {
    s.set_nonblocking(false)
        .map_err(|e| CommError::io("socket blocking", e))?;
    let uid = peer_uid(&s)?;
    if uid != my_uid() {
        return Err(CommError::Bootstrap(format!(
            "connection from uid {uid} refused"
        )));
    }
    let (q, _) = take_hello(&s, id, rank, nranks, false)?;
    Ok((q, s))
}

fn send_frame<S: FrameIo>(s: &S, tag: Tag, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if !fds.is_empty() && !s.passes_fds() {
        return Err(CommError::InvalidArgument(
            "file descriptors cannot be sent to a rank on another host".into(),
        ));
    }
    if fds.len() > MAX_FDS_PER_FRAME {
        return Err(CommError::InvalidArgument(format!(
            "{} descriptors in one frame (at most {MAX_FDS_PER_FRAME})",
            fds.len()
        )));
    }
    let h = wire::header(tag, payload.len())?;
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    // The descriptors ride on the header's bytes.
    let iov = [IoSlice::new(&h)];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let mut sent = loop {
        match sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(CommError::io("sendmsg", e.into())),
        }
    };
    if sent < HEADER_LEN {
        s.write_all(&h[sent..])
            .map_err(|e| CommError::io("send", e))?;
        sent = HEADER_LEN;
    }
    debug_assert_eq!(sent, HEADER_LEN);
    s.write_all(payload).map_err(|e| CommError::io("send", e))
}

fn recv_frame<S: FrameIo>(s: &S) -> Result<(Tag, Vec<u8>, Vec<OwnedFd>)> {
    let mut h = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut cmsg_buf = nix::cmsg_space!([RawFd; MAX_FDS_PER_FRAME]);
    let got = {
        let mut iov = [IoSliceMut::new(&mut h)];
        let msg = loop {
            match recvmsg::<()>(
                s.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg_buf),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => break m,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(CommError::io("recvmsg", e.into())),
            }
        };
        for c in msg.cmsgs().map_err(|e| CommError::io("cmsgs", e.into()))? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for fd in raw {
                    // SAFETY: the kernel installed these descriptors for us; we own them now.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        msg.bytes
    };
    if got == 0 {
        return Err(CommError::io(
            "recv",
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            ),
        ));
    }
    if got < HEADER_LEN {
        s.read_exact(&mut h[got..])
            .map_err(|e| CommError::io("recv", e))?;
    }
    let (tag, len) = wire::parse_header(&h)?;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)
        .map_err(|e| CommError::io("recv", e))?;
    Ok((tag, payload, fds))
}

/// Whether the other end of a bootstrap socket hung up (its process exited or closed its
/// communicator).
pub(crate) fn hung_up(fd: std::os::fd::RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_text_round_trip_and_rejections() {
        let id = UniqueId::random().unwrap();
        let s = id.to_string();
        assert_eq!(s.parse::<UniqueId>().unwrap(), id);
        assert!(
            !format!("{id:?}").contains(&hex(&id.secret)),
            "Debug leaks the secret"
        );
        assert!(
            s[..s.len() - 1].parse::<UniqueId>().is_err(),
            "truncated id accepted"
        );
        assert!(format!("{s}-00").parse::<UniqueId>().is_err());
        assert!("fx2-00".parse::<UniqueId>().is_err());
        assert!("".parse::<UniqueId>().is_err());
        assert_eq!(UniqueId::derived("job-7"), UniqueId::derived("job-7"));
        assert_ne!(UniqueId::derived("job-7"), UniqueId::derived("job-8"));
    }
}
