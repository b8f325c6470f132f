//! The bootstrap wire format: framed, tagged messages, with a bounds-checked decoder.
//!
//! A frame is `tag: u32 | len: u32 | payload[len]`, little-endian, at most [`MAX_PAYLOAD`]
//! bytes. File descriptors ride along as `SCM_RIGHTS` on the frame's first byte. Payloads are
//! built with [`Writer`] and read with [`Reader`], which never panics on short or garbage input.

use crate::error::{CommError, Result};

/// Largest payload a frame may carry; anything longer is a protocol error, not an allocation.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 8;

/// Message tags used on bootstrap connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Tag {
    /// Connector → listener: magic, version, ranks, secret.
    Hello = 1,
    /// Listener → connector: accepted.
    HelloAck = 2,
    /// Peer information for the all-gather.
    PeerInfo = 3,
    /// Connection setup of a channel (descriptor + fds).
    Connect = 4,
    /// Barrier token.
    Barrier = 5,
    /// TCP bootstrap, root → rank: every rank's host and address.
    Table = 6,
    /// The network transport's worker address, pair by pair.
    NetAddress = 7,
    /// Port channels (device-initiated transfers): a pair's buffers and flag word at creation,
    /// and its goodbye at close.
    Port = 8,
    /// Stream-ordered pairs on two devices: the IPC handle of the receiving side's inbox (empty
    /// where it has none).
    Inbox = 9,
    /// Staged pairs with a ring in device memory: the importing rank's verdict on the
    /// exporter's offer (see `link::devring`).
    DevRing = 10,
}

impl Tag {
    /// The tag for a raw value.
    pub fn from_u32(v: u32) -> Option<Tag> {
        Some(match v {
            1 => Tag::Hello,
            2 => Tag::HelloAck,
            3 => Tag::PeerInfo,
            4 => Tag::Connect,
            5 => Tag::Barrier,
            6 => Tag::Table,
            7 => Tag::NetAddress,
            8 => Tag::Port,
            9 => Tag::Inbox,
            10 => Tag::DevRing,
            _ => return None,
        })
    }
}

/// Encodes a frame header.
pub fn header(tag: Tag, len: usize) -> Result<[u8; HEADER_LEN]> {
    if len > MAX_PAYLOAD {
        return Err(CommError::Protocol(format!(
            "payload of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
        )));
    }
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&(tag as u32).to_le_bytes());
    h[4..].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(h)
}

/// Decodes a frame header: the tag and the payload length.
pub fn parse_header(h: &[u8; HEADER_LEN]) -> Result<(Tag, usize)> {
    let raw = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let tag =
        Tag::from_u32(raw).ok_or_else(|| CommError::Protocol(format!("unknown tag {raw}")))?;
    let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(CommError::Protocol(format!(
            "frame claims {len} bytes, over the {MAX_PAYLOAD}-byte limit"
        )));
    }
    Ok((tag, len))
}

/// Builds a payload.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty payload.
    pub fn new() -> Self {
        Self::default()
    }
    /// Appends a byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    /// Appends a little-endian u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a little-endian u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends raw bytes with a u32 length prefix.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
        self
    }
    /// Appends a UTF-8 string with a u32 length prefix.
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    /// The payload.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }
}

/// Reads a payload; every read is bounds-checked and returns a protocol error when short.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Reads `buf`, naming it `what` in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(CommError::Protocol(format!(
                "{}: truncated (needed {n} more bytes, {} left)",
                self.what,
                self.buf.len()
            )));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    /// Reads a byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    /// Reads a little-endian u32.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    /// Reads a little-endian u64.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// Reads length-prefixed bytes.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    /// Reads a length-prefixed UTF-8 string.
    pub fn str(&mut self) -> Result<String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec())
            .map_err(|_| CommError::Protocol(format!("{}: string is not UTF-8", self.what)))
    }
    /// Fails unless every byte was consumed.
    pub fn end(&self) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(CommError::Protocol(format!(
                "{}: {} trailing bytes",
                self.what,
                self.buf.len()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let p = Writer::new()
            .u8(7)
            .u32(9)
            .u64(1 << 40)
            .str("héllo")
            .bytes(&[1, 2])
            .finish();
        let mut r = Reader::new(&p, "t");
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u32().unwrap(), 9);
        assert_eq!(r.u64().unwrap(), 1 << 40);
        assert_eq!(r.str().unwrap(), "héllo");
        assert_eq!(r.bytes().unwrap(), &[1, 2]);
        r.end().unwrap();
        for cut in 0..p.len() {
            let mut r = Reader::new(&p[..cut], "t");
            let all = (|| -> Result<()> {
                r.u8()?;
                r.u32()?;
                r.u64()?;
                r.str()?;
                r.bytes()?;
                Ok(())
            })();
            assert!(all.is_err(), "truncated at {cut} decoded");
        }
    }

    #[test]
    fn headers_reject_unknown_tags_and_huge_lengths() {
        let h = header(Tag::PeerInfo, 12).unwrap();
        assert_eq!(parse_header(&h).unwrap(), (Tag::PeerInfo, 12));
        assert!(header(Tag::Barrier, MAX_PAYLOAD + 1).is_err());
        let mut bad = h;
        bad[0] = 77;
        assert!(parse_header(&bad).is_err());
        let mut huge = h;
        huge[4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_header(&huge).is_err());
    }
}
