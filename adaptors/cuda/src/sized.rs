//! The kernels behind `memcpy_sized_async` (a copy whose length the GPU reads when the stream
//! reaches it) and `stream_slot_steps` (small messages' sides through slots, one block per
//! step). Shipped as PTX (`kernels/stream.ptx`, from `kernels/stream.cu`), so neither building
//! nor running needs nvcc.
//!
//! Loaded once per device and process, by the first open of that device, and never unloaded:
//! on the H200 a module load or unload while another stream of the context waited on a value
//! hung the whole context (the conformance suite, whose cases run side by side, stalled both
//! when every adaptor loaded its own copy at open and when the first sized copy loaded it
//! behind its own stream's wait). The first open runs before any of this process's adaptors
//! on the device has a stream, and an extra retain keeps the primary context — and so the
//! module — alive until the process exits, as the CUDA runtime keeps its contexts.

use std::ffi::c_void;

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::sys;
use flagcx_adaptor::{AdaptorError, Result, SlotInbox, SlotStep};

use crate::error::call;

/// The PTX of `kernels/stream.cu`.
const PTX: &str = concat!(include_str!("../kernels/stream.ptx"), "\0");

/// The PTX of `kernels/reduce.cu` (built with `--fmad=false`).
const REDUCE_PTX: &str = concat!(include_str!("../kernels/reduce.ptx"), "\0");

/// Threads per block of `flagcx_reduce`.
const REDUCE_BLOCK: u32 = 512;
/// At most this many blocks of `flagcx_reduce` (a grid-stride loop covers the rest): enough to
/// fill the SMs of the largest GPUs several times over.
const REDUCE_MAX_GRID: u64 = 1024;

/// Threads per block.
const BLOCK: u32 = 256;
/// At most this many blocks: a stream-ordered message is small (a slot), and more blocks only
/// add launch work.
const MAX_GRID: u32 = 32;

/// Threads per block of a slot-steps launch: a 32 KiB slot in one round of four 16-byte
/// loads per thread.
const STEP_BLOCK: u32 = 512;

/// Threads per block of `flagcx_copy`.
const COPY_BLOCK: u32 = 512;

/// At most this many steps per launch (`FLAGCX_SLOT_STEPS` in `kernels/stream.cu`).
pub(crate) const MAX_STEPS: usize = 16;

/// One step as `kernels/stream.cu`'s `SlotStep` lays it out.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawStep {
    pub kind: u64,
    pub wait_at: u64,
    pub wait_min: u64,
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    pub word0: u64,
    pub value0: u64,
    pub word1: u64,
    pub value1: u64,
    pub inbox: u64,
    pub inbox_len: u64,
    pub inbox_status: u64,
    pub done_at: u64,
    pub done_value: u64,
}

/// The kernel's parameter: `FLAGCX_SLOT_STEPS` steps, the unused ones zero.
#[repr(C)]
struct RawSteps([RawStep; MAX_STEPS]);

/// The loaded module's functions (the module stays loaded for the process).
#[derive(Debug)]
pub(crate) struct SizedKernel {
    func: sys::CUfunction,
    steps: sys::CUfunction,
    /// The one-step form (120 bytes of parameters, not 1920).
    step: sys::CUfunction,
    /// `flagcx_copy`: a device-to-device copy by the SMs (`FLAGCX_CUDA_COPY_KERNEL`).
    copy: sys::CUfunction,
    /// `flagcx_reduce` (`kernels/reduce.cu`), from its own module: `None` where that module
    /// did not load (reductions are then `Unsupported`, the rest works).
    pub(crate) reduce: Option<sys::CUfunction>,
}

// SAFETY: module and function handles are driver objects usable from any thread on which
// their context is current; the driver binds the context before every use.
unsafe impl Send for SizedKernel {}
// SAFETY: as above; launches are thread-safe in the driver.
unsafe impl Sync for SizedKernel {}

/// The kernel of each device this process opened (or why it could not be loaded).
static KERNELS: Mutex<
    Option<HashMap<i32, std::result::Result<&'static SizedKernel, AdaptorError>>>,
> = Mutex::new(None);

impl SizedKernel {
    /// The kernel of `device`, loaded into its primary context (current on this thread) by the
    /// first call of the process.
    pub(crate) fn for_device(device: sys::CUdevice) -> Result<&'static SizedKernel> {
        let mut g = KERNELS.lock().unwrap_or_else(|e| e.into_inner());
        let map = g.get_or_insert_with(HashMap::new);
        map.entry(device)
            .or_insert_with(|| {
                let mut ctx = std::ptr::null_mut();
                // SAFETY: a valid out-pointer and device; never released (see the module docs).
                crate::error::call("cuDevicePrimaryCtxRetain", || unsafe {
                    sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
                })?;
                Self::load().map(|k| &*Box::leak(Box::new(k)))
            })
            .clone()
    }

    /// Loads the module into the current context.
    fn load() -> Result<Self> {
        let mut module = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a NUL-terminated PTX image; the caller made the
        // context current.
        call("cuModuleLoadData", || unsafe {
            sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast())
        })?;
        let mut func = std::ptr::null_mut();
        // SAFETY: valid out-pointer, the module loaded above, a NUL-terminated name.
        let got = call("cuModuleGetFunction", || unsafe {
            sys::cuModuleGetFunction(&mut func, module, c"flagcx_sized_copy".as_ptr())
        });
        let mut steps = std::ptr::null_mut();
        let got = got.and_then(|()| {
            // SAFETY: as above.
            call("cuModuleGetFunction", || unsafe {
                sys::cuModuleGetFunction(&mut steps, module, c"flagcx_slot_steps".as_ptr())
            })
        });
        let mut step = std::ptr::null_mut();
        let got = got.and_then(|()| {
            // SAFETY: as above.
            call("cuModuleGetFunction", || unsafe {
                sys::cuModuleGetFunction(&mut step, module, c"flagcx_slot_step".as_ptr())
            })
        });
        let mut copy = std::ptr::null_mut();
        let got = got.and_then(|()| {
            // SAFETY: as above.
            call("cuModuleGetFunction", || unsafe {
                sys::cuModuleGetFunction(&mut copy, module, c"flagcx_copy".as_ptr())
            })
        });
        let k = SizedKernel {
            func,
            steps,
            step,
            copy,
            reduce: got.is_ok().then(load_reduce).flatten(),
        };
        if let Err(e) = got.and_then(|()| k.warm_up()) {
            // SAFETY: loaded above, used by nothing.
            unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(k)
    }

    /// One launch of nothing, synchronized: with lazy module loading (the default since CUDA
    /// 11.7) the function is loaded at its first launch, and that load waits for the context
    /// — on the H200 it hung a first sized copy enqueued behind a stream wait that the same
    /// thread would have satisfied next. Here nothing of this process waits yet.
    fn warm_up(&self) -> Result<()> {
        let mut word = 0u64;
        // SAFETY: a valid out-pointer; freed below.
        call("cuMemAlloc", || unsafe { sys::cuMemAlloc_v2(&mut word, 8) })?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; 1 = CU_STREAM_NON_BLOCKING.
        let r = call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut stream, 1)
        })
        .and_then(|()| {
            // SAFETY: the kernel reads the 8-byte word (whatever it holds, a capacity of 0
            // copies nothing: n = 0 copies zero bytes, more copies none) and touches no
            // other memory; the stream is synchronized before the word is freed.
            unsafe { self.launch(0, 0, word, 0, stream as u64) }?;
            let nothing = RawStep {
                kind: 2,
                word0: word,
                ..RawStep::default()
            };
            // SAFETY: takes with no wait (`wait_at` 0) and a capacity of 0: each reads the
            // word and copies no byte whatever it holds. One step and two load both forms
            // of the kernel, as the launch above does its own.
            unsafe {
                self.launch_steps(&[nothing], stream as u64)?;
                self.launch_steps(&[nothing, nothing], stream as u64)?;
                // SAFETY: a copy of zero bytes touches no memory.
                self.launch_copy(word, word, 0, 1, stream as u64)
            }?;
            if self.reduce.is_some() {
                let sum = flagcx_adaptor::ReduceStep::Combine(flagcx_adaptor::ReduceOp::Sum);
                // SAFETY: one byte in place on the 8-byte word (its value does not matter).
                unsafe {
                    self.launch_reduce(
                        stream as u64,
                        word,
                        word,
                        word,
                        1,
                        flagcx_adaptor::DataType::U8,
                        sum,
                    )
                }?;
            }
            // SAFETY: the stream created above.
            call("cuStreamSynchronize", || unsafe {
                sys::cuStreamSynchronize(stream)
            })
        });
        // SAFETY: created and allocated above; nothing runs on them any more (or the failure
        // is returned, and the module is unloaded).
        unsafe {
            if !stream.is_null() {
                sys::cuStreamDestroy_v2(stream);
            }
            sys::cuMemFree_v2(word);
        }
        r
    }

    /// Launches the copy on `stream`.
    ///
    /// # Safety
    /// The contract of `DeviceAdaptor::memcpy_sized_async`; the context is current.
    pub(crate) unsafe fn launch(
        &self,
        dst: u64,
        src: u64,
        len_at: u64,
        cap: usize,
        stream: u64,
    ) -> Result<()> {
        let grid = (cap as u64)
            .div_ceil(BLOCK as u64 * 16)
            .clamp(1, MAX_GRID as u64) as u32;
        let (mut d, mut s, mut l, mut c) = (dst, src, len_at, cap as u64);
        let mut params: [*mut c_void; 4] = [
            (&mut d as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
            (&mut l as *mut u64).cast(),
            (&mut c as *mut u64).cast(),
        ];
        // SAFETY: four pointers to u64 values, matching the kernel's four `.u64` parameters,
        // alive for the call (the driver copies them at launch); the memory the kernel touches
        // is the caller's contract.
        unsafe { launch_1d(self.func, grid, BLOCK, stream, &mut params) }
    }
}

impl SizedKernel {
    /// Launches `steps` (at most [`MAX_STEPS`]) on `stream`, one block each.
    ///
    /// # Safety
    /// The contract of `DeviceAdaptor::stream_slot_steps` for the steps they encode; the
    /// context is current.
    pub(crate) unsafe fn launch_steps(&self, steps: &[RawStep], stream: u64) -> Result<()> {
        if steps.is_empty() || steps.len() > MAX_STEPS {
            return Err(AdaptorError::invalid(
                "stream_slot_steps",
                "between 1 and 16 steps per launch",
            ));
        }
        // Only the form launched is built (a call of one step is the common case).
        let mut one;
        let mut raw;
        let (func, param): (_, *mut c_void) = if let [step] = steps {
            one = *step;
            (self.step, (&mut one as *mut RawStep).cast())
        } else {
            raw = RawSteps([RawStep::default(); MAX_STEPS]);
            raw.0[..steps.len()].copy_from_slice(steps);
            (self.steps, (&mut raw as *mut RawSteps).cast())
        };
        let mut params: [*mut c_void; 1] = [param];
        // SAFETY: one pointer to a value laid out as the kernel's one by-value struct
        // parameter (one 120-byte step of u64 fields, or sixteen), alive for the call (the
        // driver copies it at launch); the memory the steps touch is the caller's contract.
        unsafe { launch_1d(func, steps.len() as u32, STEP_BLOCK, stream, &mut params) }
    }
}

impl SizedKernel {
    /// Launches `flagcx_copy` of `n` bytes from `src` to `dst` on `stream`, with at most
    /// `max_grid` blocks of [`COPY_BLOCK`] threads (each round of a block moves 32 KiB: four
    /// 16-byte loads in flight per thread).
    ///
    /// # Safety
    /// Both ranges are device memory this context can access (its own, or a peer's mapped
    /// with access enabled), valid until the stream passes the copy; the context is current.
    pub(crate) unsafe fn launch_copy(
        &self,
        dst: u64,
        src: u64,
        n: usize,
        max_grid: u32,
        stream: u64,
    ) -> Result<()> {
        let grid = (n as u64)
            .div_ceil(COPY_BLOCK as u64 * 64)
            .clamp(1, max_grid.max(1) as u64) as u32;
        let (mut d, mut s, mut len) = (dst, src, n as u64);
        let mut params: [*mut c_void; 3] = [
            (&mut d as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
            (&mut len as *mut u64).cast(),
        ];
        // SAFETY: three pointers to u64 values, matching the kernel's three `.u64`
        // parameters, alive for the call (the driver copies them at launch); the memory the
        // kernel touches is the caller's contract.
        unsafe { launch_1d(self.copy, grid, COPY_BLOCK, stream, &mut params) }
    }
}

/// `cuLaunchKernel` of `func` as a 1-D grid of `grid` blocks of `block` threads on `stream`,
/// without dynamic shared memory.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, each to a value of exactly the type the
/// kernel declares, alive for the call (the driver copies them at launch); whatever the kernel
/// touches stays valid until it completes; `func`'s context is current.
pub(crate) unsafe fn launch_1d(
    func: sys::CUfunction,
    grid: u32,
    block: u32,
    stream: u64,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller's contract; the stream handle is the driver's CUstream.
    call("cuLaunchKernel", || unsafe {
        sys::cuLaunchKernel(
            func,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream as sys::CUstream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

/// Loads `kernels/reduce.ptx` into the current context and finds `flagcx_reduce`; `None`
/// where the driver refuses it (the adaptor then claims no reduction types).
fn load_reduce() -> Option<sys::CUfunction> {
    let mut module = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and a NUL-terminated PTX image; the context is current.
    let loaded = call("cuModuleLoadData", || unsafe {
        sys::cuModuleLoadData(&mut module, REDUCE_PTX.as_ptr().cast())
    });
    let mut func = std::ptr::null_mut();
    let got = loaded.and_then(|()| {
        // SAFETY: valid out-pointer, the module loaded above, a NUL-terminated name.
        call("cuModuleGetFunction", || unsafe {
            sys::cuModuleGetFunction(&mut func, module, c"flagcx_reduce".as_ptr())
        })
    });
    got.ok().map(|()| func)
}

impl SizedKernel {
    /// Launches `flagcx_reduce` over `count` elements (`count > 0`); `step` and the scales as
    /// `kernels/reduce.cu` reads them.
    ///
    /// # Safety
    /// The contract of `DeviceAdaptor::reduce_async` (operands checked by the core); the
    /// context is current.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch_reduce(
        &self,
        stream: u64,
        dst: u64,
        a: u64,
        b: u64,
        count: usize,
        dtype: flagcx_adaptor::DataType,
        step: flagcx_adaptor::ReduceStep,
    ) -> Result<()> {
        let Some(func) = self.reduce else {
            return Err(AdaptorError::Unsupported {
                vendor: flagcx_adaptor::Vendor::Cuda,
                op: "reduce_async",
            });
        };
        let (mut code, mut n, mut s32, mut s64) = match step {
            flagcx_adaptor::ReduceStep::Combine(op) => (op as i32, 1u32, 0f32, 0f64),
            flagcx_adaptor::ReduceStep::Average { n } => {
                let s = flagcx_adaptor::reduce::average_scale(dtype, n).unwrap_or(0.0);
                (4, n, s as f32, s)
            }
        };
        let (mut d, mut x, mut y, mut c, mut t) = (dst, a, b, count as u64, dtype as i32);
        let grid = (count as u64)
            .div_ceil(REDUCE_BLOCK as u64 * 4)
            .clamp(1, REDUCE_MAX_GRID) as u32;
        let mut params: [*mut c_void; 9] = [
            (&mut d as *mut u64).cast(),
            (&mut x as *mut u64).cast(),
            (&mut y as *mut u64).cast(),
            (&mut c as *mut u64).cast(),
            (&mut t as *mut i32).cast(),
            (&mut code as *mut i32).cast(),
            (&mut n as *mut u32).cast(),
            (&mut s32 as *mut f32).cast(),
            (&mut s64 as *mut f64).cast(),
        ];
        // SAFETY: nine pointers to values of the kernel's parameter types (u64 x4, s32, s32,
        // u32, f32, f64), alive for the call; the memory it touches is the caller's contract.
        unsafe { launch_1d(func, grid, REDUCE_BLOCK, stream, &mut params) }
    }
}

/// A step as the kernel reads it (`kernels/stream.cu`).
pub(crate) fn raw_step(step: &SlotStep) -> RawStep {
    let inbox = |i: Option<SlotInbox>| i.map_or((0, 0, 0), |i| (i.slot.0, i.len_at.0, i.status.0));
    match *step {
        SlotStep::Put {
            wait,
            src,
            len,
            slot,
            writes,
            inbox: i,
            ..
        } => {
            let (inbox, inbox_len, inbox_status) = inbox(i);
            RawStep {
                kind: 1,
                wait_at: wait.map_or(0, |w| w.0 .0),
                wait_min: wait.map_or(0, |w| w.1),
                src: src.0,
                dst: slot.0,
                len: len as u64,
                word0: writes[0].0 .0,
                value0: writes[0].1,
                word1: writes[1].0 .0,
                value1: writes[1].1,
                inbox,
                inbox_len,
                inbox_status,
                ..RawStep::default()
            }
        }
        SlotStep::Take {
            wait,
            slot,
            len_at,
            dst,
            cap,
            inbox: i,
            done,
        } => {
            let (inbox, inbox_len, inbox_status) = inbox(i);
            RawStep {
                kind: 2,
                wait_at: wait.0 .0,
                wait_min: wait.1,
                src: slot.0,
                dst: dst.0,
                len: cap as u64,
                word0: len_at.0,
                inbox,
                inbox_len,
                inbox_status,
                done_at: done.map_or(0, |d| d.0 .0),
                done_value: done.map_or(0, |d| d.1),
                ..RawStep::default()
            }
        }
    }
}

/// The variable that makes device-to-device copies of at least [`COPY_KERNEL_MIN`] bytes run
/// on the SMs (`flagcx_copy`) instead of a copy engine: `off` (the default), `local` (both
/// ends in this GPU's memory), `all` (also into or out of a peer's memory mapped here).
pub(crate) const COPY_KERNEL_ENV: &str = "FLAGCX_CUDA_COPY_KERNEL";

/// Smallest copy [`COPY_KERNEL_ENV`] moves to the SMs; below it a launch gains nothing.
pub(crate) const COPY_KERNEL_MIN: usize = 1 << 20;

/// [`COPY_KERNEL_ENV`]'s value read: `None` for off (or unset), else whether peer memory too.
fn copy_kernel_mode(v: Option<&str>) -> Result<Option<bool>> {
    match v.map(str::trim) {
        None | Some("" | "off") => Ok(None),
        Some("local") => Ok(Some(false)),
        Some("all") => Ok(Some(true)),
        Some(other) => Err(AdaptorError::invalid(
            "FLAGCX_CUDA_COPY_KERNEL",
            format!("{other:?} is not one of off, local, all"),
        )),
    }
}

/// Which device-to-device copies of one device the SMs make (see [`COPY_KERNEL_ENV`]).
#[derive(Debug)]
pub(crate) struct KernelCopies {
    kernel: &'static SizedKernel,
    device: sys::CUdevice,
    /// Peer memory too, not only this device's.
    all: bool,
    /// Most blocks per copy: two per SM.
    grid: u32,
}

impl KernelCopies {
    /// The policy [`COPY_KERNEL_ENV`] asks for on `device` (`None`: none, or `off`); an
    /// unknown value is an error, as is asking for it where the kernel could not be loaded.
    pub(crate) fn from_env(
        kernel: Option<&'static SizedKernel>,
        device: sys::CUdevice,
    ) -> Result<Option<Self>> {
        let Some(all) = copy_kernel_mode(std::env::var(COPY_KERNEL_ENV).ok().as_deref())? else {
            return Ok(None);
        };
        let kernel = kernel.ok_or_else(|| {
            AdaptorError::invalid(
                "FLAGCX_CUDA_COPY_KERNEL",
                "the adaptor's kernels could not be loaded on this device (driver too old?)",
            )
        })?;
        let mut sms = 0;
        // SAFETY: a valid out-pointer and device.
        call("cuDeviceGetAttribute", || unsafe {
            sys::cuDeviceGetAttribute(
                &mut sms,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                device,
            )
        })?;
        Ok(Some(KernelCopies {
            kernel,
            device,
            all,
            grid: (sms.max(1) as u32).saturating_mul(2),
        }))
    }

    /// Whether a copy of `n` bytes between `dst` and `src` is the kernel's: large enough, both
    /// ends 16-byte aligned (the kernel moves misaligned ranges a byte at a time), and under
    /// `local` both in this device's memory (a pointer the driver cannot place stays with the
    /// copy engine).
    fn takes(&self, dst: u64, src: u64, n: usize) -> bool {
        if n < COPY_KERNEL_MIN || (dst | src) % 16 != 0 {
            return false;
        }
        self.all
            || [dst, src]
                .iter()
                .all(|&p| self.ordinal(p) == Some(self.device))
    }

    /// The device whose memory `p` is, as the driver reports it.
    fn ordinal(&self, p: u64) -> Option<sys::CUdevice> {
        let mut ordinal: i32 = -1;
        // SAFETY: a valid out-pointer of the attribute's type (int); the driver validates `p`.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p,
            )
        };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(ordinal)
    }

    /// Launches the copy on the SMs if it is theirs (`Ok(true)`); `Ok(false)`: the caller
    /// issues it on a copy engine.
    ///
    /// # Safety
    /// As `DeviceAdaptor::memcpy_d2d_async`; the context is current.
    pub(crate) unsafe fn try_copy(
        &self,
        dst: u64,
        src: u64,
        n: usize,
        stream: u64,
    ) -> Result<bool> {
        if !self.takes(dst, src, n) {
            return Ok(false);
        }
        // SAFETY: the caller's contract; memory of this device, or a peer's mapped here (the
        // copy engine's contract is the same: the context reaches both ranges).
        unsafe { self.kernel.launch_copy(dst, src, n, self.grid, stream) }?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::{copy_kernel_mode, RawStep, RawSteps, PTX, REDUCE_PTX};

    #[test]
    fn the_shipped_reduction_ptx_takes_nine_parameters_and_never_contracts() {
        assert!(REDUCE_PTX.contains(".entry flagcx_reduce("));
        assert!(REDUCE_PTX.contains("flagcx_reduce_param_8"));
        assert!(!REDUCE_PTX.contains("flagcx_reduce_param_9"));
        // Built with --fmad=false: no fused multiply-add may round differently from the host.
        for fused in ["fma.", "mad."] {
            assert!(!REDUCE_PTX.contains(fused), "reduce.ptx contains {fused}");
        }
        assert!(
            REDUCE_PTX.contains(".version 7.0"),
            "lowered to 7.0 for CUDA 11 drivers"
        );
    }

    #[test]
    fn the_shipped_ptx_takes_the_steps_as_rust_lays_them_out() {
        let one = format!(
            "flagcx_slot_step_param_0[{}]",
            std::mem::size_of::<RawStep>()
        );
        let all = format!(
            "flagcx_slot_steps_param_0[{}]",
            std::mem::size_of::<RawSteps>()
        );
        assert!(PTX.contains(&one), "stream.ptx does not declare {one}");
        assert!(PTX.contains(&all), "stream.ptx does not declare {all}");
        assert!(PTX.contains(".entry flagcx_copy("));
    }

    #[test]
    fn copy_kernel_values_parse_and_typos_are_refused() {
        assert_eq!(copy_kernel_mode(None).unwrap(), None);
        assert_eq!(copy_kernel_mode(Some("off")).unwrap(), None);
        assert_eq!(copy_kernel_mode(Some(" local")).unwrap(), Some(false));
        assert_eq!(copy_kernel_mode(Some("all")).unwrap(), Some(true));
        let e = copy_kernel_mode(Some("locals")).unwrap_err().to_string();
        assert!(
            e.contains("FLAGCX_CUDA_COPY_KERNEL") && e.contains("locals"),
            "{e}"
        );
    }
}
