//! The shared adaptor conformance suite, run against OpenCL device `FLAGCX_DEVICE` (default 0).
//! Without an OpenCL platform every case reports `skipped: <reason>`.

fn open() -> flagcx_adaptor::Result<flagcx_opencl::OpenClAdaptor> {
    let device = std::env::var("FLAGCX_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    flagcx_opencl::OpenClAdaptor::open(device)
}

flagcx_adaptor::conformance_tests!(open());
