//! Copy speed between an OpenCL device and host memory of each kind, through the adaptor (what
//! the staging ring's copies do): `cargo run --release -p flagcx-opencl --example pin_speed`.
//! With `OCL_ICD_FILENAMES` pointing at NVIDIA's library, the pinned rows should approach the
//! bus (`../shared/probes/ocl_pinned.c` measures 55 GB/s on an H200 host).

use std::time::Instant;

use flagcx_adaptor::{DeviceAdaptor, DeviceBuffer, Stream};
use flagcx_opencl::OpenClAdaptor;

fn main() -> flagcx_adaptor::Result<()> {
    let probe = OpenClAdaptor::open(0)?;
    for i in 0..probe.device_count()? {
        println!("device {i}: {:?}", probe.properties(i)?);
    }
    // The device to measure: the first argument (default 0).
    let dev = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(0);
    let a = OpenClAdaptor::open(dev)?;
    println!("measuring device {dev}");
    let size = 256usize << 20;
    let s = Stream::new(&a)?;
    let d = DeviceBuffer::new(&a, size)?;
    let rate = |label: &str, p: *mut u8| -> flagcx_adaptor::Result<()> {
        for chunk in [size, 4 << 20] {
            let t = Instant::now();
            for _ in 0..4 {
                for off in (0..size).step_by(chunk) {
                    // SAFETY: `p..p+size` is live memory and `d` holds `size` bytes; both outlive
                    // the synchronize below.
                    unsafe {
                        a.memcpy_h2d_async(
                            flagcx_adaptor::DevicePtr(d.ptr().0 + off as u64),
                            p.add(off),
                            chunk,
                            s.handle(),
                        )?
                    };
                }
            }
            s.synchronize()?;
            let h2d = (4 * size) as f64 / t.elapsed().as_secs_f64() / 1e9;
            let t = Instant::now();
            for _ in 0..4 {
                for off in (0..size).step_by(chunk) {
                    // SAFETY: as above.
                    unsafe {
                        a.memcpy_d2h_async(
                            p.add(off),
                            flagcx_adaptor::DevicePtr(d.ptr().0 + off as u64),
                            chunk,
                            s.handle(),
                        )?
                    };
                }
            }
            s.synchronize()?;
            let d2h = (4 * size) as f64 / t.elapsed().as_secs_f64() / 1e9;
            println!(
                "{label:<44} chunk {:>4} MiB  H2D {h2d:6.1} GB/s  D2H {d2h:6.1} GB/s",
                chunk >> 20
            );
        }
        Ok(())
    };
    let host = a.host_alloc(size)?;
    rate("host_alloc, not pinned", host)?;
    // SAFETY: `host` stays allocated until after the unpin.
    unsafe { a.host_pin(host, size)? };
    rate("host_alloc, pinned (USE_HOST_PTR wrap + map)", host)?;
    // SAFETY: no copy is in flight.
    unsafe { a.host_unpin(host)? };
    rate("host_alloc, unpinned again", host)?;
    let mut v = vec![7u8; size];
    // SAFETY: `v` outlives the unpin below.
    unsafe { a.host_pin(v.as_mut_ptr(), size)? };
    rate("Vec, pinned", v.as_mut_ptr())?;
    // SAFETY: no copy is in flight.
    unsafe { a.host_unpin(v.as_mut_ptr())? };
    // SAFETY: allocated above, unused.
    unsafe { a.host_free(host)? };
    Ok(())
}
