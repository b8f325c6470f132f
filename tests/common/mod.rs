//! Helpers shared by the multi-process test binaries.

/// The launcher: `FLAGCX_RUN`, else a `flagcx-run` beside this binary (the GPU bundle), else
/// the one cargo built with this test.
pub fn flagcx_run() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("FLAGCX_RUN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("current_exe");
    let beside = exe.with_file_name("flagcx-run");
    if beside.is_file() {
        return beside;
    }
    env!("CARGO_BIN_EXE_flagcx-run").into()
}
