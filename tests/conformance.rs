//! The conformance suite through the facade's dispatch enum, on whatever vendor the environment
//! picks (`FLAGCX_VENDOR`, else detection).

flagcx_adaptor::conformance_tests!(flagcx::Adaptor::from_env());

/// Another runtime's memory through an fd (`Capabilities::ipc_fd_foreign`): a CUDA allocation
/// exported as an fd and mapped by OpenCL on the same GPU (NVIDIA's platform), bytes checked
/// both ways through device copies on each side. Skipped, and reported, where either runtime,
/// the capability or a shared GPU is missing (CI: PoCL imports nothing).
#[test]
fn opencl_maps_a_cuda_export() {
    use flagcx::{Adaptor, DeviceAdaptor, DeviceBuffer, Stream, Vendor};
    use flagcx_adaptor::conformance::{report_skip, report_skip_reason};
    const TEST: &str = "conformance::opencl_maps_a_cuda_export";
    let (cuda, ocl) = match (
        Adaptor::open(Vendor::Cuda, 0),
        Adaptor::open(Vendor::OpenCl, 0),
    ) {
        (Ok(c), Ok(o)) => (c, o),
        (Err(e), _) | (_, Err(e)) => return report_skip(TEST, &e),
    };
    let bus = |a: &Adaptor| a.properties(0).expect("properties").pci_bus_id;
    if !(ocl.capabilities().ipc_fd_foreign && cuda.capabilities().ipc_fd) {
        let why = "the OpenCL platform imports no fds, or CUDA exports none";
        return report_skip_reason(TEST, "opencl", why);
    }
    if bus(&cuda).is_none() || bus(&cuda) != bus(&ocl) {
        return report_skip_reason(
            TEST,
            "opencl",
            "CUDA and OpenCL device 0 are different GPUs",
        );
    }
    let len = 3 << 20;
    let pattern = |seed: u8| -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    };
    let (cs, os) = (Stream::new(&cuda).unwrap(), Stream::new(&ocl).unwrap());
    let exported = DeviceBuffer::new_shareable(&cuda, len).expect("shareable allocation");
    exported.write(0, &pattern(1), &cs).expect("CUDA write");
    let h = exported.ipc_fd().expect("export");
    let mapped = ocl.ipc_import_fd(&h).expect("OpenCL maps CUDA's export");
    let own = DeviceBuffer::new(&ocl, len).expect("OpenCL buffer");
    let mut out = vec![0u8; len];
    // SAFETY: both ranges hold `len` bytes and live until the synchronizing read below.
    unsafe { ocl.memcpy_d2d_async(own.ptr(), mapped, len, os.handle()) }.expect("copy out");
    own.read(0, &mut out, &os).expect("read");
    assert!(out == pattern(1), "OpenCL read CUDA's bytes wrong");
    own.write(0, &pattern(2), &os).expect("OpenCL write");
    // SAFETY: as above.
    unsafe { ocl.memcpy_d2d_async(mapped, own.ptr(), len, os.handle()) }.expect("copy in");
    os.synchronize().expect("sync");
    exported.read(0, &mut out, &cs).expect("CUDA read");
    assert!(out == pattern(2), "CUDA read OpenCL's bytes wrong");
    // A CUDA allocation is not OpenCL's to free; closing the mapping is.
    // SAFETY: refused before anything is released (checked).
    assert!(unsafe { ocl.mem_free(mapped) }.is_err());
    // SAFETY: the copies above completed.
    unsafe { ocl.ipc_close(mapped) }.expect("close the mapping");
}
