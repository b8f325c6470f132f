//! `cargo xtask bundle`: filled in with the CUDA adaptor.

pub(crate) fn bundle(_vendors: &Option<Vec<String>>) -> crate::Result {
    Err("bundle needs a GPU vendor crate; none is in the workspace yet".into())
}
