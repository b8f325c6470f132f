//! The conformance suite through the facade's dispatch enum, on whatever vendor the environment
//! picks (`FLAGCX_VENDOR`, else detection).

flagcx_adaptor::conformance_tests!(flagcx::Adaptor::from_env());
