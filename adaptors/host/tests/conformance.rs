//! The shared adaptor conformance suite, run against the host vendor.

flagcx_adaptor::conformance_tests!(flagcx_host::HostAdaptor::open(0));
