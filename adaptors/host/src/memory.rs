//! Host-vendor memory: memfd-backed "device" allocations and a process-wide range registry.
//!
//! Device memory is a `memfd` mapped `MAP_SHARED`, so another process can map the very same
//! pages (through the fd, or through `/proc/<pid>/fd/<n>` for the byte-form handle). The
//! registry records every range the "device" may touch, which lets the adaptor refuse null,
//! foreign or out-of-bounds device pointers with a typed error instead of faulting.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

use flagcx_adaptor::tracking::RangeMap;
use flagcx_adaptor::{AdaptorError, DevicePtr, Result};

/// What a registered range is.
#[derive(Debug)]
pub(crate) enum RangeKind {
    /// A device allocation of device `device`, backed by `fd`.
    Device { device: usize, fd: OwnedFd },
    /// Pinned host memory from `host_alloc` (anonymous mapping).
    Pinned,
    /// An existing host mapping registered by the user (not owned).
    Registered,
    /// A mapping of another allocation opened through IPC, backed by `fd`; `from`: the handle
    /// it was opened by, where it came as one (not through an fd).
    IpcOpened {
        fd: OwnedFd,
        from: Option<flagcx_adaptor::hostmem::HostMemHandle>,
    },
    /// Another process's registered memory opened through IPC: synthetic addresses standing
    /// for `addr..` in process `pid`, which only device-to-device copies reach (`crate::cma`).
    Remote { pid: u32, addr: u64 },
}

/// Checks that `n` bytes at `addr` lie in one range of `reg` that this process's CPU can
/// touch: anything but another process's memory ([`RangeKind::Remote`]).
pub(crate) fn check_local(reg: &Registry, op: &'static str, addr: u64, n: usize) -> Result<()> {
    match remote_at(reg, op, addr, n)? {
        Some((pid, _)) => Err(AdaptorError::invalid(
            op,
            format!(
                "{addr:#x} stands for registered memory of process {pid}: only device-to-device \
                 copies reach it"
            ),
        )),
        None => Ok(()),
    }
}

/// Checks that `n` bytes at `addr` lie in one range of `reg`; where that range is another
/// process's memory ([`RangeKind::Remote`]), that process and the address there.
pub(crate) fn remote_at(
    reg: &Registry,
    op: &'static str,
    addr: u64,
    n: usize,
) -> Result<Option<(u32, u64)>> {
    match reg.check(op, addr, n)? {
        (base, RangeKind::Remote { pid, addr: there }) => Ok(Some((*pid, there + (addr - base)))),
        _ => Ok(None),
    }
}

/// Every device-visible range of this process.
pub(crate) type Registry = RangeMap<RangeKind>;

pub(crate) fn registry() -> MutexGuard<'static, Registry> {
    static REG: OnceLock<Mutex<Registry>> = OnceLock::new();
    // Each update is one insert or remove, so a poisoned lock is still consistent.
    REG.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// A fresh memfd of `len` bytes.
pub(crate) fn memfd(len: usize) -> Result<OwnedFd> {
    // SAFETY: memfd_create takes a valid C string; the result is checked.
    let raw = unsafe { libc::memfd_create(c"flagcx-host-device".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(AdaptorError::last_os("memfd_create"));
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(len)
        .map_err(|_| AdaptorError::invalid("mem_alloc", format!("{len} bytes is too large")))?;
    // SAFETY: valid descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(AdaptorError::last_os("ftruncate"));
    }
    Ok(fd)
}

pub(crate) use flagcx_adaptor::hostmem::map_shared;

/// Maps `len` bytes of private anonymous memory.
pub(crate) fn map_anonymous(len: usize) -> Result<u64> {
    // SAFETY: as above.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(AdaptorError::last_os("mmap"));
    }
    Ok(p as u64)
}

/// Unmaps a mapping made by [`map_shared`] or [`map_anonymous`].
///
/// # Safety
/// `base..base+len` is a mapping this module made and nothing uses it any more.
pub(crate) unsafe fn unmap(base: u64, len: usize) {
    // SAFETY: forwarded contract.
    unsafe {
        libc::munmap(base as *mut libc::c_void, len);
    }
}

/// The system's physical memory, the host device's "total memory".
pub(crate) fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages > 0 && size > 0 {
        pages as u64 * size as u64
    } else {
        1 << 30
    }
}

/// A close-on-exec duplicate of `fd` (numbered 3 or above).
pub(crate) fn dup_cloexec(op: &'static str, fd: &OwnedFd) -> Result<OwnedFd> {
    // SAFETY: duplicating a valid descriptor; the result is checked and owned.
    let raw = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if raw < 0 {
        return Err(AdaptorError::last_os(op));
    }
    // SAFETY: `raw` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Maps a peer's allocation opened as `fd` and records it as opened through IPC.
pub(crate) fn map_opened(
    op: &'static str,
    fd: OwnedFd,
    size: usize,
    from: Option<flagcx_adaptor::hostmem::HostMemHandle>,
) -> Result<DevicePtr> {
    let _call = crate::freesync::call();
    let base = map_shared(&fd, size)?;
    let kind = RangeKind::IpcOpened { fd, from };
    if let Err(e) = registry().insert(op, base, size, kind) {
        // SAFETY: the mapping was made just above and is not yet published.
        unsafe { unmap(base, size) };
        return Err(e);
    }
    Ok(DevicePtr(base))
}
