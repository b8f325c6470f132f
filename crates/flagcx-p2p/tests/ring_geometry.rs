//! The staged ring's default geometry follows its size: slots of a quarter of the ring, at
//! most 8 MiB (measured on the H200: 4 slots of 8 MiB beat 8 of 4 MiB for CUDA↔OpenCL and
//! CUDA↔CUDA pairs from 16 MiB: git show 7ff18bc:docs/performance.md), and an explicit slot size wins.

use flagcx_p2p::Config;

fn with(vars: &[(&str, &str)]) -> Config {
    let c = Config::from_lookup(|name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    })
    .expect("valid settings");
    c.validate().expect("a valid geometry");
    c
}

#[test]
fn slots_are_a_quarter_of_the_ring_up_to_8_mib() {
    let c = with(&[]);
    assert_eq!((c.buffsize, c.chunksize), (32 << 20, 8 << 20));
    let c = with(&[("FLAGCX_P2P_BUFFSIZE", "8M")]);
    assert_eq!(c.chunksize, 2 << 20, "a small ring keeps four slots");
    let c = with(&[("FLAGCX_P2P_BUFFSIZE", "512K")]);
    assert_eq!(c.chunksize, 128 << 10);
    let c = with(&[("FLAGCX_P2P_BUFFSIZE", "128M")]);
    assert_eq!(
        c.chunksize,
        8 << 20,
        "a large ring gets more slots, not larger ones"
    );
    let c = with(&[("FLAGCX_P2P_BUFFSIZE", "1000000")]);
    assert_eq!(c.chunksize % 64, 0, "rounded to the slot alignment");
    assert!(c.buffsize >= 4 * c.chunksize);
}

#[test]
fn an_explicit_slot_size_wins() {
    let c = with(&[
        ("FLAGCX_P2P_BUFFSIZE", "32M"),
        ("FLAGCX_P2P_CHUNKSIZE", "4M"),
    ]);
    assert_eq!(c.chunksize, 4 << 20);
    let e = Config::from_lookup(|name| (name == "FLAGCX_P2P_CHUNKSIZE").then(|| "32M".into()))
        .expect_err("one 32 MiB slot in a 32 MiB ring cannot pipeline");
    assert!(e.to_string().contains("FLAGCX_P2P_BUFFSIZE"), "{e}");
}
