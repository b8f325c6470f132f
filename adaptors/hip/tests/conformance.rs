//! The shared adaptor conformance suite, run against HIP device `FLAGCX_DEVICE` (default 0).
//! Without an AMD GPU every case reports `skipped: <reason>` (typically `hipErrorNoDevice`).

fn open() -> flagcx_adaptor::Result<flagcx_hip::HipAdaptor> {
    let device = std::env::var("FLAGCX_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    flagcx_hip::HipAdaptor::open(device)
}

flagcx_adaptor::conformance_tests!(open());
