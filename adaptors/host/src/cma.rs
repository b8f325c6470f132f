//! Registered host memory between processes: copies through the kernel (cross-memory attach).
//!
//! A peer process can map the host vendor's device memory (a memfd), but not the memory a user
//! registered (`host_register`: a numpy array, a torch CPU tensor, `malloc` memory): it is
//! private to its process. Such a range still gets a byte-form IPC handle, naming the process
//! and the address ([`ProcMemHandle`]). Opening it reserves a range of *synthetic* addresses in
//! the importer (never a CPU address: the non-canonical upper half, as OpenCL's buffers) that
//! only device-to-device copies accept; the stream worker runs such a copy as one
//! `process_vm_readv` / `process_vm_writev`, which moves the bytes between the two processes'
//! private pages in one pass, as a copy between two mappings of shared memory would.
//!
//! Without this, a user's buffer went through a staging buffer of device memory on both ends:
//! three copies where a device buffer needs one (torch CPU tensors over the host vendor moved
//! at 0.38–0.54 × the package's own buffers).
//!
//! Permission: the kernel allows it where the importer could ptrace the exporter (same user).
//! Where Yama's `ptrace_scope` is 1 only ancestors may, so an exporter first lets any process
//! of its user in (`PR_SET_PTRACER_ANY`, as Open MPI's shared-memory transport does); a refusal
//! (a container without `process_vm_readv`, `ptrace_scope` 2 or 3) is an error at open, with
//! the errno, never a wrong copy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use flagcx_adaptor::{AdaptorError, IpcMemHandle, Result, Vendor, IPC_HANDLE_BYTES};

const MAGIC: &[u8; 4] = b"FXP1";

/// Where synthetic addresses start: the non-canonical upper half, which no CPU address of
/// this process can be.
pub(crate) const SYNTHETIC_BASE: u64 = 0xFC00_0000_0000_0000;

/// Gap left between two synthetic ranges (so an overrun of one is never inside another).
const SYNTHETIC_GAP: u64 = 1 << 16;

/// A decoded handle of registered memory: `size` bytes at `addr` in process `pid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcMemHandle {
    pub pid: u32,
    pub addr: u64,
    pub size: usize,
}

impl ProcMemHandle {
    /// Encodes as a host-vendor [`IpcMemHandle`] (its own magic, so the memfd form's decoder
    /// refuses it).
    pub fn encode(&self) -> IpcMemHandle {
        let mut b = [0u8; IPC_HANDLE_BYTES];
        b[0..4].copy_from_slice(MAGIC);
        b[4..8].copy_from_slice(&self.pid.to_le_bytes());
        b[16..24].copy_from_slice(&(self.size as u64).to_le_bytes());
        b[24..32].copy_from_slice(&self.addr.to_le_bytes());
        IpcMemHandle {
            vendor: Vendor::Host,
            bytes: b,
        }
    }

    /// Decodes a handle of this form; `None` for any other (a memfd handle, another vendor's).
    /// A handle with this form's magic but malformed fields is an error.
    pub fn decode(op: &'static str, h: &IpcMemHandle) -> Result<Option<Self>> {
        let b = &h.bytes;
        if h.vendor != Vendor::Host || &b[0..4] != MAGIC {
            return Ok(None);
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let d = ProcMemHandle {
            pid: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            addr: u64_at(24),
            size: usize::try_from(u64_at(16))
                .map_err(|_| AdaptorError::invalid(op, "size does not fit this platform"))?,
        };
        let tail_clear = b[8..16].iter().chain(&b[32..]).all(|&x| x == 0);
        let in_bounds = d.addr.checked_add(d.size as u64).is_some();
        if !tail_clear || d.pid == 0 || d.size == 0 || d.addr == 0 || !in_bounds {
            return Err(AdaptorError::invalid(
                op,
                "malformed host-vendor IPC handle of registered memory",
            ));
        }
        Ok(Some(d))
    }
}

/// Lets processes of this user copy from and to this process's memory (once; see the module
/// doc). Without Yama the call fails with `EINVAL` and nothing is needed.
pub(crate) fn allow_peers() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: prctl with integer arguments only; a failure changes nothing.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    });
}

/// A fresh synthetic range of `len` bytes (see [`SYNTHETIC_BASE`]).
pub(crate) fn reserve(len: usize) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(SYNTHETIC_BASE);
    let span = (len as u64).next_multiple_of(SYNTHETIC_GAP) + SYNTHETIC_GAP;
    NEXT.fetch_add(span, Ordering::Relaxed)
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// From the other process into this one.
    Read,
    /// From this process into the other.
    Write,
}

/// Copies `n` bytes between `local` (this process) and `remote` (process `pid`), in the
/// direction `way`; short transfers go on from where they stopped.
///
/// # Safety
/// `local..local + n` is memory of this process that the copy may read (`Write`) or write
/// (`Read`), and nothing else uses it meanwhile.
pub(crate) unsafe fn copy(way: Way, pid: u32, local: u64, remote: u64, n: usize) -> Result<()> {
    let mut done = 0usize;
    while done < n {
        let lv = libc::iovec {
            iov_base: (local + done as u64) as *mut libc::c_void,
            iov_len: n - done,
        };
        let rv = libc::iovec {
            iov_base: (remote + done as u64) as *mut libc::c_void,
            iov_len: n - done,
        };
        // SAFETY: one iovec each, describing the caller's local range (its contract) and the
        // peer's range, which the kernel checks against the peer's mappings (a hole is EFAULT,
        // never a write here).
        let r = unsafe {
            match way {
                Way::Read => libc::process_vm_readv(pid as libc::pid_t, &lv, 1, &rv, 1, 0),
                Way::Write => libc::process_vm_writev(pid as libc::pid_t, &lv, 1, &rv, 1, 0),
            }
        };
        match r {
            r if r > 0 => done += r as usize,
            0 => {
                return Err(AdaptorError::invalid(
                    "process memory copy",
                    format!(
                        "process {pid} moved no bytes at {:#x}",
                        remote + done as u64
                    ),
                ))
            }
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(refusal(e));
            }
        }
    }
    Ok(())
}

/// The error for a copy the kernel refused: the errno kept, the step naming why in the user's
/// terms.
fn refusal(e: std::io::Error) -> AdaptorError {
    let op = match e.raw_os_error() {
        Some(libc::EPERM) => {
            "process_vm_readv/writev on registered memory (not permitted: cross-memory attach \
             needs the same user, a Yama ptrace_scope of 0 or 1, and a container that allows \
             the call)"
        }
        Some(libc::ESRCH) => "process_vm_readv/writev on registered memory (the process is gone)",
        Some(libc::EFAULT) => {
            "process_vm_readv/writev on registered memory (the address is not mapped there, or not accessible)"
        }
        _ => "process_vm_readv/writev on registered memory",
    };
    AdaptorError::Os { op, source: e }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_other_forms_are_not_taken() {
        let h = ProcMemHandle {
            pid: 42,
            addr: 0x7f00_1234_5000,
            size: 12345,
        };
        assert_eq!(ProcMemHandle::decode("t", &h.encode()).unwrap(), Some(h));
        let mut other = h.encode();
        other.bytes[0..4].copy_from_slice(b"FXH1");
        assert_eq!(ProcMemHandle::decode("t", &other).unwrap(), None);
        let mut bad = h.encode();
        bad.bytes[40] = 1;
        assert!(ProcMemHandle::decode("t", &bad).is_err());
        let wraps = ProcMemHandle {
            addr: u64::MAX - 10,
            ..h
        };
        assert!(ProcMemHandle::decode("t", &wraps.encode()).is_err());
    }

    #[test]
    fn copies_through_the_kernel_and_refuses_holes() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let me = std::process::id();
        // SAFETY: both vectors are this process's memory, alive across the calls.
        unsafe {
            copy(
                Way::Read,
                me,
                dst.as_mut_ptr() as u64,
                src.as_ptr() as u64,
                src.len(),
            )
            .unwrap();
        }
        assert_eq!(dst, src);
        let mut back = vec![0u8; 1000];
        // SAFETY: as above.
        unsafe {
            copy(
                Way::Write,
                me,
                src.as_ptr() as u64,
                back.as_mut_ptr() as u64,
                1000,
            )
            .unwrap();
        }
        assert_eq!(back[..], src[..1000]);
        // A synthetic address is never mapped: the kernel refuses with EFAULT.
        // SAFETY: as above; the remote side is checked by the kernel.
        let e = unsafe { copy(Way::Read, me, dst.as_mut_ptr() as u64, 0x10, 8) }.unwrap_err();
        assert!(format!("{e:?}").contains("not mapped"), "{e:?}");
    }
}
