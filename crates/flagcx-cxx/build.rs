//! Compiles the C++ side of the cxx bridge (the glue `comm.hpp` calls into).
fn main() {
    cxx_build::bridge("src/lib.rs")
        .std("c++17")
        .compile("flagcx-cxx-bridge");
    println!("cargo:rerun-if-changed=src/lib.rs");
}
