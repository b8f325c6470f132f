//! `cargo xtask capi [--vendor …]`: builds libflagcx (the C ABI) and installs it with its
//! header and a pkg-config file under `target/flagcx`:
//!
//! ```text
//! target/flagcx/include/flagcx.h
//! target/flagcx/lib/libflagcx.so.0, libflagcx.so -> libflagcx.so.0, libflagcx.a
//! target/flagcx/lib/pkgconfig/flagcx.pc
//! target/flagcx/include/flagcx/comm.hpp, bridge.h; include/rust/cxx.h (the C++ API)
//! target/flagcx/include/flagcx/device.cuh (port channels' device side, CUDA and HIP)
//! target/flagcx/lib/libflagcx_cxx.a, pkgconfig/flagcx-cxx.pc, cmake/Flagcx/FlagcxConfig.cmake
//! ```
//!
//! A C program then builds with `cc prog.c $(pkg-config --cflags --libs flagcx)` once
//! `PKG_CONFIG_PATH` includes `target/flagcx/lib/pkgconfig` (the library path is baked in as
//! an rpath, so it runs without `LD_LIBRARY_PATH`).

use std::path::{Path, PathBuf};

use crate::{cargo, root, run, Result};

/// Builds (release) and installs; returns the prefix (`target/flagcx`).
pub(crate) fn capi(vendors: &[String]) -> Result<PathBuf> {
    let features: Vec<String> = vendors.iter().map(|v| v.to_string()).collect();
    // Both libraries in one build: one feature resolution, so the library crates under them
    // are compiled once (two builds compiled flagcx-p2p twice in release).
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "flagcx-capi",
        "-p",
        "flagcx-cxx",
    ]);
    if !features.is_empty() {
        build.args(["--features", &features.join(",")]);
    }
    run(
        "building libflagcx and libflagcx_cxx (crates/flagcx-capi, crates/flagcx-cxx)",
        &mut build,
    )?;
    let release = root().join("target/release");
    install(
        &release.join("libflagcx_capi.so"),
        &release.join("libflagcx_capi.a"),
        &release.join("libflagcx_cxx.a"),
        vendors,
    )
}

/// Installs the libraries the test suites' own build made, so the suites need no release
/// build of their own; returns the prefix. `messages` is the stdout of that build run with
/// `--message-format=json-render-diagnostics`: its artifact records name the very files (the
/// C++ crate's archive carries a hash in its name, and archives of other feature sets may lie
/// beside it). The default target selection builds both library crates as libraries; with
/// `--lib --tests` or `test = false` cargo builds only their unit-test executables.
pub(crate) fn capi_from_test_build(messages: &str) -> Result<PathBuf> {
    let mut files: Vec<PathBuf> = Vec::new();
    for line in messages.lines() {
        let Ok(m) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = m["target"]["name"].as_str().unwrap_or_default();
        if m["reason"] == "compiler-artifact" && (name == "flagcx_capi" || name == "flagcx_cxx") {
            let names = m["filenames"].as_array().cloned().unwrap_or_default();
            files.extend(names.iter().filter_map(|f| f.as_str().map(PathBuf::from)));
        }
    }
    let find = |stem: &str, ext: &str| {
        files
            .iter()
            .find(|f| {
                let n = f.file_name().map(|n| n.to_string_lossy().to_string());
                n.is_some_and(|n| n.starts_with(stem) && n.ends_with(ext))
            })
            .cloned()
            .ok_or_else(|| format!("the test build reported no {stem}*{ext}"))
    };
    install(
        &find("libflagcx_capi", ".so")?,
        &find("libflagcx_capi", ".a")?,
        &find("libflagcx_cxx", ".a")?,
        &[],
    )
}

/// Installs `so` and `a` (libflagcx) and `cxx_a` (libflagcx_cxx) with the headers and the
/// pkg-config and CMake files under `target/flagcx`; returns that prefix.
fn install(so: &Path, a: &Path, cxx_a: &Path, vendors: &[String]) -> Result<PathBuf> {
    let prefix = root().join("target/flagcx");
    let _ = std::fs::remove_dir_all(&prefix);
    for d in ["include", "lib/pkgconfig"] {
        std::fs::create_dir_all(prefix.join(d)).map_err(|e| format!("{d}: {e}"))?;
    }
    copy(
        &root().join("crates/flagcx-capi/include/flagcx.h"),
        &prefix.join("include/flagcx.h"),
    )?;
    copy(so, &prefix.join("lib/libflagcx.so.0"))?;
    std::os::unix::fs::symlink("libflagcx.so.0", prefix.join("lib/libflagcx.so"))
        .map_err(|e| format!("symlink libflagcx.so: {e}"))?;
    copy(a, &prefix.join("lib/libflagcx.a"))?;
    // The C++ API: flagcx/comm.hpp over the cxx bridge (its generated header and cxx's own).
    for d in ["include/flagcx", "include/rust", "lib/cmake/Flagcx"] {
        std::fs::create_dir_all(prefix.join(d)).map_err(|e| format!("{d}: {e}"))?;
    }
    copy(
        &root().join("crates/flagcx-cxx/include/flagcx/comm.hpp"),
        &prefix.join("include/flagcx/comm.hpp"),
    )?;
    // The device side of port channels, for CUDA and HIP kernels.
    copy(
        &root().join("crates/flagcx-p2p/include/flagcx/device.cuh"),
        &prefix.join("include/flagcx/device.cuh"),
    )?;
    copy(
        &root().join("target/cxxbridge/flagcx-cxx/src/lib.rs.h"),
        &prefix.join("include/flagcx/bridge.h"),
    )?;
    copy(
        &root().join("target/cxxbridge/rust/cxx.h"),
        &prefix.join("include/rust/cxx.h"),
    )?;
    copy(cxx_a, &prefix.join("lib/libflagcx_cxx.a"))?;
    let mut private = String::from("-lpthread -ldl -lm -lrt -lutil -lgcc_s");
    if vendors.iter().any(|v| v == "hip") {
        private.push_str(" -lamdhip64");
    }
    let pc = format!(
        "prefix={}\n\
         libdir=${{prefix}}/lib\n\
         includedir=${{prefix}}/include\n\n\
         Name: flagcx\n\
         Description: flagcx-rs: cross-vendor point-to-point communication, FlagCX-compatible C ABI\n\
         Version: {}\n\
         Cflags: -I${{includedir}}\n\
         Libs: -L${{libdir}} -Wl,-rpath,${{libdir}} -lflagcx\n\
         Libs.private: {private}\n",
        prefix.display(),
        workspace_version(),
    );
    std::fs::write(prefix.join("lib/pkgconfig/flagcx.pc"), pc).map_err(|e| e.to_string())?;
    let cxx_pc = format!(
        "prefix={}\n\
         libdir=${{prefix}}/lib\n\
         includedir=${{prefix}}/include\n\n\
         Name: flagcx-cxx\n\
         Description: flagcx-rs for C++: flagcx::Comm (flagcx/comm.hpp)\n\
         Version: {}\n\
         Cflags: -I${{includedir}} -std=c++17\n\
         Libs: -L${{libdir}} -lflagcx_cxx {private}\n",
        prefix.display(),
        workspace_version(),
    );
    std::fs::write(prefix.join("lib/pkgconfig/flagcx-cxx.pc"), cxx_pc)
        .map_err(|e| e.to_string())?;
    let cmake =
        format!(
        "# Flagcx: find_package(Flagcx CONFIG) gives Flagcx::flagcx (the C library, flagcx.h)\n\
         # and Flagcx::cxx (the C++ API, flagcx/comm.hpp).\n\
         get_filename_component(_flagcx_prefix \"${{CMAKE_CURRENT_LIST_DIR}}/../../..\" ABSOLUTE)\n\
         if(NOT TARGET Flagcx::flagcx)\n\
         \x20 add_library(Flagcx::flagcx SHARED IMPORTED)\n\
         \x20 set_target_properties(Flagcx::flagcx PROPERTIES\n\
         \x20   IMPORTED_LOCATION \"${{_flagcx_prefix}}/lib/libflagcx.so.0\"\n\
         \x20   IMPORTED_SONAME \"libflagcx.so.0\"\n\
         \x20   INTERFACE_INCLUDE_DIRECTORIES \"${{_flagcx_prefix}}/include\")\n\
         endif()\n\
         if(NOT TARGET Flagcx::cxx)\n\
         \x20 add_library(Flagcx::cxx STATIC IMPORTED)\n\
         \x20 set_target_properties(Flagcx::cxx PROPERTIES\n\
         \x20   IMPORTED_LOCATION \"${{_flagcx_prefix}}/lib/libflagcx_cxx.a\"\n\
         \x20   INTERFACE_INCLUDE_DIRECTORIES \"${{_flagcx_prefix}}/include\"\n\
         \x20   INTERFACE_COMPILE_FEATURES cxx_std_17\n\
         \x20   INTERFACE_LINK_LIBRARIES \"{}\")\n\
         endif()\n\
         set(Flagcx_FOUND TRUE)\n",
        private.replace("-l", "").split_whitespace().collect::<Vec<_>>().join(";"),
    );
    std::fs::write(prefix.join("lib/cmake/Flagcx/FlagcxConfig.cmake"), cmake)
        .map_err(|e| e.to_string())?;
    println!(
        "capi: installed {} (PKG_CONFIG_PATH={}/lib/pkgconfig)",
        prefix.display(),
        prefix.display()
    );
    Ok(prefix)
}

fn copy(from: &Path, to: &Path) -> Result {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("copy {} to {}: {e}", from.display(), to.display()))
}

/// The workspace's version (`[workspace.package] version` in the root Cargo.toml).
fn workspace_version() -> String {
    std::fs::read_to_string(root().join("Cargo.toml"))
        .ok()
        .and_then(|t| {
            t.lines()
                .skip_while(|l| l.trim() != "[workspace.package]")
                .find_map(|l| {
                    l.trim()
                        .strip_prefix("version = ")
                        .map(|v| v.trim_matches('"').to_string())
                })
        })
        .unwrap_or_else(|| "0.0.0".into())
}
