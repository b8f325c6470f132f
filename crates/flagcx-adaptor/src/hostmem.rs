//! Host-vendor memory handles: device memory that every vendor's process can map.
//!
//! The host vendor's device memory is a memfd mapped shared. Its byte-form IPC handle names the
//! exporter's descriptor (pid and fd number) and the file's identity (inode and device), so any
//! process of the same user can open `/proc/<pid>/fd/<n>`, check that it is still the same file,
//! and map the very same pages. The format and the opening live here, in the vendor-neutral
//! crate, because two kinds of process need them: the host adaptor itself (its `ipc_open_handle`)
//! and a process of *another* vendor that maps a host rank's buffer to copy straight into it
//! (flagcx-p2p's direct path for a heterogeneous pair).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{AdaptorError, Result};
use crate::types::{IpcMemHandle, Vendor, IPC_HANDLE_BYTES};

const MAGIC: &[u8; 4] = b"FXH1";

/// A decoded host-vendor IPC handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemHandle {
    /// The exporting process.
    pub pid: u32,
    /// The descriptor number of the allocation in the exporter.
    pub fd: i32,
    /// Bytes of the allocation.
    pub size: usize,
    /// Inode of the allocation's memfd (proves identity after an fd number is reused).
    pub ino: u64,
    /// Device of that inode.
    pub dev: u64,
    /// Where the allocation lies in the exporter's address space (0: not said). An importer
    /// that emulates CUDA's mapping rule (`FLAGCX_HOST_IPC_AS_CUDA` in the host adaptor) compares
    /// it with the allocations of that process it maps already.
    pub base: u64,
}

impl HostMemHandle {
    /// The handle of allocation `fd` (of `size` bytes) of this process.
    pub fn of_fd(fd: &OwnedFd, size: usize) -> Result<Self> {
        let (ino, dev) = fd_identity(fd)?;
        Ok(HostMemHandle {
            pid: std::process::id(),
            fd: fd.as_raw_fd(),
            size,
            ino,
            dev,
            base: 0,
        })
    }

    /// The same handle, saying that the allocation lies at `base` in the exporter.
    pub fn at(self, base: u64) -> Self {
        HostMemHandle { base, ..self }
    }

    /// Encodes as a host-vendor [`IpcMemHandle`].
    pub fn encode(&self) -> IpcMemHandle {
        let mut b = [0u8; IPC_HANDLE_BYTES];
        b[0..4].copy_from_slice(MAGIC);
        b[4..8].copy_from_slice(&self.pid.to_le_bytes());
        b[8..12].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&(self.size as u64).to_le_bytes());
        b[24..32].copy_from_slice(&self.ino.to_le_bytes());
        b[32..40].copy_from_slice(&self.dev.to_le_bytes());
        b[40..48].copy_from_slice(&self.base.to_le_bytes());
        IpcMemHandle {
            vendor: Vendor::Host,
            bytes: b,
        }
    }

    /// Decodes a host-vendor handle; anything else (another vendor's handle, garbage) is an
    /// [`AdaptorError::InvalidArgument`] naming `op`.
    pub fn decode(op: &'static str, h: &IpcMemHandle) -> Result<Self> {
        if h.vendor != Vendor::Host {
            return Err(AdaptorError::invalid(
                op,
                format!("a {} handle is not host-vendor memory", h.vendor),
            ));
        }
        let b = &h.bytes;
        if &b[0..4] != MAGIC || b[12..16].iter().chain(&b[48..]).any(|&x| x != 0) {
            return Err(AdaptorError::invalid(op, "not a host-vendor IPC handle"));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let d = HostMemHandle {
            pid: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            fd: i32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            size: usize::try_from(u64_at(16))
                .map_err(|_| AdaptorError::invalid(op, "size does not fit this platform"))?,
            ino: u64_at(24),
            dev: u64_at(32),
            base: u64_at(40),
        };
        if d.fd < 0 || d.size == 0 || d.pid == 0 {
            return Err(AdaptorError::invalid(
                op,
                "malformed host-vendor IPC handle",
            ));
        }
        Ok(d)
    }

    /// Opens the exporter's allocation through `/proc/<pid>/fd/<n>` and checks it is still the
    /// allocation the handle names (same inode, at least `size` bytes).
    pub fn open(&self, op: &'static str) -> Result<OwnedFd> {
        let path = format!("/proc/{}/fd/{}\0", self.pid, self.fd);
        // SAFETY: `path` is NUL-terminated; the result is checked.
        let raw = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            let err = std::io::Error::last_os_error();
            return Err(AdaptorError::invalid(
                op,
                format!(
                    "cannot reach the exporter's allocation (pid {}, fd {}): {err}; \
                     the exporting process or allocation is gone, or the handle is forged",
                    self.pid, self.fd
                ),
            ));
        }
        // SAFETY: a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // The fd number may have been reused by the exporter: the inode proves identity.
        if fd_identity(&fd)? != (self.ino, self.dev) || fd_size(&fd)? < self.size {
            return Err(AdaptorError::invalid(
                op,
                "the handle's allocation no longer exists (stale handle)",
            ));
        }
        Ok(fd)
    }
}

/// The inode and device of an fd, which recognise an allocation across processes.
pub fn fd_identity(fd: &OwnedFd) -> Result<(u64, u64)> {
    let st = fstat(fd)?;
    Ok((st.st_ino, st.st_dev))
}

/// The size of the file behind an fd.
pub fn fd_size(fd: &OwnedFd) -> Result<usize> {
    Ok(fstat(fd)?.st_size as usize)
}

fn fstat(fd: &OwnedFd) -> Result<libc::stat> {
    // SAFETY: fstat fills the zeroed struct for a valid descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(AdaptorError::last_os("fstat"));
    }
    Ok(st)
}

/// Maps `len` bytes of `fd` shared and read-write; returns the base address.
pub fn map_shared(fd: &OwnedFd, len: usize) -> Result<u64> {
    // SAFETY: a new mapping at an address the kernel picks; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(AdaptorError::last_os("mmap"));
    }
    Ok(p as u64)
}

/// Unmaps a mapping made by [`map_shared`].
///
/// # Safety
/// `base..base+len` is a mapping made by [`map_shared`] that nothing uses any more.
pub unsafe fn unmap(base: u64, len: usize) {
    // SAFETY: forwarded contract.
    unsafe {
        libc::munmap(base as *mut libc::c_void, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: usize) -> OwnedFd {
        // SAFETY: a valid C string; the result is checked below.
        let raw = unsafe { libc::memfd_create(c"hostmem-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) }, 0);
        fd
    }

    #[test]
    fn handle_round_trips_and_opens_the_same_pages() {
        let fd = memfd(8192);
        let h = HostMemHandle::of_fd(&fd, 8192)
            .unwrap()
            .at(0x7f00_0000_0000);
        let wire = h.encode();
        assert_eq!(HostMemHandle::decode("t", &wire).unwrap(), h);
        let a = map_shared(&fd, 8192).unwrap();
        let other = h.open("t").unwrap();
        let b = map_shared(&other, 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes long and live until the unmaps below.
        unsafe {
            (a as *mut u8).add(4000).write(0x5a);
            assert_eq!((b as *const u8).add(4000).read(), 0x5a);
            unmap(a, 8192);
            unmap(b, 8192);
        }
    }

    #[test]
    fn garbage_and_stale_handles_are_refused() {
        let fd = memfd(4096);
        let h = HostMemHandle::of_fd(&fd, 4096).unwrap();
        let mut wire = h.encode();
        wire.vendor = Vendor::Cuda;
        assert!(HostMemHandle::decode("t", &wire).is_err());
        let mut wire = h.encode();
        wire.bytes[50] = 1;
        assert!(HostMemHandle::decode("t", &wire).is_err());
        // Larger than the file: refused on open.
        let big = HostMemHandle { size: 1 << 20, ..h };
        assert!(big.open("t").is_err());
        // The allocation is gone: refused.
        drop(fd);
        assert!(h.open("t").is_err());
    }
}
