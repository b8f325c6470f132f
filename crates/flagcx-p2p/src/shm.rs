//! Shared host memory: anonymous memfd segments, passed between processes by file descriptor.
//!
//! There is no name in /dev/shm, so nothing is left behind when a process dies (the kernel frees
//! the pages with the last mapping) and a small /dev/shm (64 MB in containers) does not matter.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{CommError, Result};

/// A shared mapping of a memfd.
#[derive(Debug)]
pub struct ShmSegment {
    file: File,
    map: MmapRaw,
}

impl ShmSegment {
    /// Creates a zero-filled segment of `len` bytes; `name` shows in `/proc/<pid>/maps`.
    pub fn create(name: &str, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(CommError::InvalidArgument(
                "zero-length shared segment".into(),
            ));
        }
        let cname = std::ffi::CString::new(name)
            .map_err(|_| CommError::InvalidArgument("segment name contains NUL".into()))?;
        // SAFETY: a valid C string; the result is checked.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(CommError::io(
                "memfd_create",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a new descriptor nobody else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        file.set_len(len as u64)
            .map_err(|e| CommError::io("ftruncate shared segment", e))?;
        Self::map(file, len)
    }

    /// Maps a segment received from a peer; it must hold at least `len` bytes.
    pub fn open(fd: OwnedFd, len: usize) -> Result<Self> {
        let file = File::from(fd);
        let have = file
            .metadata()
            .map_err(|e| CommError::io("fstat shared segment", e))?
            .len();
        if have < len as u64 || len == 0 {
            return Err(CommError::Protocol(format!(
                "shared segment holds {have} bytes, the peer announced {len}"
            )));
        }
        Self::map(file, len)
    }

    fn map(file: File, len: usize) -> Result<Self> {
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| CommError::io("mmap shared segment", e))?;
        Ok(ShmSegment { file, map })
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True for an empty mapping (never: creation refuses zero length).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The descriptor, to send to a peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_segment_share_bytes_and_leave_no_file() {
        let a = ShmSegment::create("flagcx-test", 8192).unwrap();
        let b = ShmSegment::open(a.fd().try_clone_to_owned().unwrap(), 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes long and alive.
        unsafe {
            *a.as_ptr().add(4000) = 42;
            assert_eq!(*b.as_ptr().add(4000), 42);
        }
        let too_long = ShmSegment::open(a.fd().try_clone_to_owned().unwrap(), 8193);
        assert!(too_long.is_err());
        let shm: Vec<_> = std::fs::read_dir("/dev/shm")
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(!shm.iter().any(|n| n.to_string_lossy().contains("flagcx")));
    }
}
