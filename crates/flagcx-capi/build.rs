//! The shared library installs as `libflagcx.so.0` (`cargo xtask capi`): give it that soname,
//! so programs linked with `-lflagcx` record the versioned name.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libflagcx.so.0");
}
