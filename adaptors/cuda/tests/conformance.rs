//! The shared adaptor conformance suite, run against CUDA device `FLAGCX_DEVICE` (default 0).
//! Without a driver or a GPU every case reports `skipped: <reason>`.

fn open() -> flagcx_adaptor::Result<flagcx_cuda::CudaAdaptor> {
    let device = std::env::var("FLAGCX_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    flagcx_cuda::CudaAdaptor::open(device)
}

flagcx_adaptor::conformance_tests!(open());
