//! `FLAGCX_HOST_IPC_AS_CUDA=1`: IPC opens that refuse what CUDA's refuse, so that CPU-only runs
//! catch code that maps a peer's new allocation while it still maps a freed one.
//!
//! A process that frees an allocation another process maps keeps its pages alive (the
//! importer's mapping holds them) but gives its addresses back, and its next allocation may
//! lie at the same addresses. CUDA then refuses to map that new allocation in the importer
//! while the old mapping is open (`cuIpcOpenMemHandle`: `CUDA_ERROR_ALREADY_MAPPED`), and
//! closing the old mapping waits for every stream of the device. The host vendor normally maps
//! anything; with this variable set, an open is refused the same way where this process maps
//! an allocation of the same exporter whose addresses there overlap the new one's (known from
//! the handle: [`HostMemHandle::base`]). With `FLAGCX_HOST_FREE_SYNC=1` as well, the close
//! waits for the streams as CUDA's does.

use std::sync::OnceLock;

use flagcx_adaptor::hostmem::HostMemHandle;
use flagcx_adaptor::{AdaptorError, Result, Vendor};

use crate::memory::{RangeKind, Registry};

/// Environment variable: `1` refuses IPC opens as CUDA does (see the module docs).
pub const IPC_AS_CUDA_ENV: &str = "FLAGCX_HOST_IPC_AS_CUDA";

/// The code of an emulated refusal: CUDA's `CUDA_ERROR_ALREADY_MAPPED`.
const ALREADY_MAPPED: i64 = 208;

pub(crate) fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(IPC_AS_CUDA_ENV).is_ok_and(|v| v.trim() == "1"))
}

/// Whether two exporter ranges `[base, base + len)` share a byte (an unknown base never does).
fn overlap(a: &HostMemHandle, b: &HostMemHandle) -> bool {
    a.base != 0
        && b.base != 0
        && a.base < b.base.saturating_add(b.size as u64)
        && b.base < a.base.saturating_add(a.size as u64)
}

/// With the emulation on: refuses to map `new` where `reg` maps another allocation of the same
/// exporter at overlapping addresses, as CUDA does.
pub(crate) fn check(op: &'static str, reg: &Registry, new: &HostMemHandle) -> Result<()> {
    if !on() {
        return Ok(());
    }
    let clash = reg.values().any(|k| match k {
        RangeKind::IpcOpened {
            from: Some(old), ..
        } => old.pid == new.pid && (old.ino, old.dev) != (new.ino, new.dev) && overlap(old, new),
        _ => false,
    });
    match clash {
        true => Err(AdaptorError::Vendor {
            vendor: Vendor::Host,
            op,
            code: ALREADY_MAPPED,
            name: "hostErrorAlreadyMapped".into(),
        }),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_another_allocation_of_the_same_exporter_at_overlapping_addresses_clashes() {
        let h = |pid, ino, base, size| HostMemHandle {
            pid,
            fd: 3,
            size,
            ino,
            dev: 1,
            base,
        };
        let old = h(10, 5, 0x10000, 0x2000);
        assert!(overlap(&old, &h(10, 6, 0x11000, 0x100)));
        assert!(!overlap(&old, &h(10, 6, 0x12000, 0x100)), "right after it");
        assert!(!overlap(&old, &h(10, 6, 0, 0x100)), "base unknown");
    }
}
