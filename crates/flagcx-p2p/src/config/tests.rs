//! `Config` parsing: every variable, strictly.

use super::*;

#[test]
fn root_addresses_come_from_the_environment() {
    let env = |vars: &[(&str, &str)]| {
        RankEnv::from_lookup(|n| {
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        })
    };
    let root = |e: Result<RankEnv>| e.expect("rank env").id.root();
    let base = [
        ("FLAGCX_RANK", "1"),
        ("FLAGCX_NRANKS", "2"),
        (
            "FLAGCX_UNIQUE_ID",
            "fx1-00112233445566778899aabbccddeeff-00112233445566778899aabbccddeeff",
        ),
    ];
    assert_eq!(root(env(&base)), None);
    let mut with = base.to_vec();
    with.push(("FLAGCX_ROOT_ADDR", "127.0.0.1:29600"));
    assert_eq!(root(env(&with)), Some("127.0.0.1:29600".parse().unwrap()));
    let torch = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("FLAGCX_BOOTSTRAP", "tcp"),
    ];
    assert_eq!(root(env(&torch)), Some("127.0.0.1:29501".parse().unwrap()));
    let mut tcp_alone = base.to_vec();
    tcp_alone.push(("FLAGCX_BOOTSTRAP", "tcp"));
    assert!(matches!(
        env(&tcp_alone),
        Err(CommError::Config { name, .. }) if name == "FLAGCX_BOOTSTRAP"
    ));
    let mut bad = base.to_vec();
    bad.push(("FLAGCX_BOOTSTRAP", "udp"));
    assert!(env(&bad).is_err());
    // srun: ranks and a job id from Slurm, the root from FLAGCX_ROOT_ADDR.
    let slurm = [
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_JOB_ID", "77"),
        ("SLURM_STEP_ID", "0"),
        ("FLAGCX_ROOT_ADDR", "127.0.0.1:29600"),
    ];
    let e = env(&slurm).expect("slurm env");
    assert_eq!(
        (e.rank, e.nranks, e.local_rank, e.source),
        (3, 4, 1, "slurm")
    );
    assert_eq!(e.id.root(), Some("127.0.0.1:29600".parse().unwrap()));
    assert_eq!(
        e.id.to_string().split('@').next(),
        UniqueId::derived("slurm:77.0")
            .to_string()
            .split('@')
            .next()
    );
}

#[test]
fn sizes_and_bools_parse_strictly() {
    assert_eq!(parse_size("X", "4M").unwrap(), 4 << 20);
    assert_eq!(parse_size("X", " 512k ").unwrap(), 512 << 10);
    assert_eq!(parse_size("X", "123").unwrap(), 123);
    for bad in ["", "M", "4Q", "-1", "1.5M", "99999999999999999999G"] {
        let e = parse_size("FLAGCX_P2P_BUFFSIZE", bad).unwrap_err();
        assert!(e.to_string().contains("FLAGCX_P2P_BUFFSIZE"), "{e}");
    }
    assert!(parse_bool("X", "yes").unwrap());
    assert!(!parse_bool("X", "0").unwrap());
    assert!(parse_bool("X", "maybe").is_err());
}

fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

#[test]
fn rank_comes_from_flagcx_torchrun_or_open_mpi() {
    let id = UniqueId::random().unwrap().to_string();
    let e = RankEnv::from_lookup(lookup(&[
        ("FLAGCX_RANK", "2"),
        ("FLAGCX_NRANKS", "4"),
        ("FLAGCX_UNIQUE_ID", &id),
    ]))
    .unwrap();
    assert_eq!(
        (e.rank, e.nranks, e.local_rank, e.source),
        (2, 4, 2, "flagcx")
    );
    assert_eq!(e.id.to_string(), id);

    let torch = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("TORCHELASTIC_RUN_ID", "j7"),
    ];
    let t = RankEnv::from_lookup(lookup(&torch)).unwrap();
    assert_eq!(
        (t.rank, t.nranks, t.local_rank, t.source),
        (1, 2, 1, "torchrun")
    );
    // Every rank of the job derives the same id.
    assert_eq!(t.id, RankEnv::from_lookup(lookup(&torch)).unwrap().id);

    let mpi = [
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
        ("OMPI_MCA_orte_ess_jobid", "12345"),
    ];
    let m = RankEnv::from_lookup(lookup(&mpi)).unwrap();
    assert_eq!((m.rank, m.nranks, m.source), (3, 8, "openmpi"));
    assert_ne!(m.id, t.id);
}

#[test]
fn malformed_or_missing_rank_variables_are_errors() {
    assert!(RankEnv::from_lookup(lookup(&[])).is_err());
    let bad = [("FLAGCX_RANK", "x"), ("FLAGCX_NRANKS", "2")];
    let e = RankEnv::from_lookup(lookup(&bad)).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_RANK"), "{e}");
    let out_of_range = [
        ("FLAGCX_RANK", "2"),
        ("FLAGCX_NRANKS", "2"),
        ("FLAGCX_UNIQUE_ID", "fx1-00-00"),
    ];
    assert!(RankEnv::from_lookup(lookup(&out_of_range)).is_err());
    // torchrun without a job identifier cannot derive a shared id.
    let no_job = [("RANK", "0"), ("WORLD_SIZE", "2")];
    assert!(RankEnv::from_lookup(lookup(&no_job)).is_err());
    let forged = [
        ("FLAGCX_RANK", "0"),
        ("FLAGCX_NRANKS", "2"),
        ("FLAGCX_UNIQUE_ID", "fx1-zz"),
    ];
    assert!(RankEnv::from_lookup(lookup(&forged)).is_err());
}

#[test]
fn eager_limit_parses_and_is_bounded() {
    assert!(Config::default().ipc_caller);
    assert_eq!(Config::default().waiter_progress, None);
    for (v, want) in [("on", Some(true)), ("0", Some(false)), ("auto", None)] {
        let c = Config::from_lookup(lookup(&[("FLAGCX_P2P_WAITER_PROGRESS", v)])).unwrap();
        assert_eq!(c.waiter_progress, want, "{v}");
    }
    let e = Config::from_lookup(lookup(&[("FLAGCX_P2P_WAITER_PROGRESS", "yes")])).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_P2P_WAITER_PROGRESS"), "{e}");
    let off = Config::from_lookup(lookup(&[("FLAGCX_P2P_IPC_CALLER", "off")])).unwrap();
    assert!(!off.ipc_caller);
    let e = Config::from_lookup(lookup(&[("FLAGCX_P2P_IPC_CALLER", "maybe")])).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_P2P_IPC_CALLER"), "{e}");
    assert_eq!(Config::default().eager_max, 32 << 10);
    let c = Config::from_lookup(lookup(&[("FLAGCX_P2P_EAGER_MAX", "16K")])).unwrap();
    assert_eq!(c.eager_max, 16 << 10);
    let off = Config::from_lookup(lookup(&[("FLAGCX_P2P_EAGER_MAX", "0")])).unwrap();
    assert_eq!(off.eager_max, 0);
    let e = Config::from_lookup(lookup(&[("FLAGCX_P2P_EAGER_MAX", "65537")])).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_P2P_EAGER_MAX"), "{e}");
    assert!(Config::from_lookup(lookup(&[("FLAGCX_P2P_EAGER_MAX", "lots")])).is_err());
    assert_eq!(Config::default().rejoin_wait, Duration::from_millis(1));
    let c = Config::from_lookup(lookup(&[("FLAGCX_P2P_REJOIN_US", "250")])).unwrap();
    assert_eq!(c.rejoin_wait, Duration::from_micros(250));
    let off = Config::from_lookup(lookup(&[("FLAGCX_P2P_REJOIN_US", "0")])).unwrap();
    assert!(off.rejoin_wait.is_zero());
    let e = Config::from_lookup(lookup(&[("FLAGCX_P2P_REJOIN_US", "10000001")])).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_P2P_REJOIN_US"), "{e}");
    assert!(Config::from_lookup(lookup(&[("FLAGCX_P2P_REJOIN_US", "soon")])).is_err());
}

#[test]
fn stream_joins_parse_strictly() {
    for (v, want) in [
        ("gate", StreamJoin::Gate),
        (" HostFn ", StreamJoin::HostFn),
        ("memop", StreamJoin::MemOp),
        ("none", StreamJoin::None),
    ] {
        let c = Config::from_lookup(lookup(&[("FLAGCX_STREAM_JOIN", v)])).unwrap();
        assert_eq!(c.join, want, "{v}");
    }
    let e = Config::from_lookup(lookup(&[("FLAGCX_STREAM_JOIN", "gates")])).unwrap_err();
    assert!(e.to_string().contains("expected auto, memop, gate"), "{e}");
}

#[test]
fn copier_and_spin_parse_strictly() {
    let c = Config::from_lookup(lookup(&[
        ("FLAGCX_P2P_IPC_COPIER", " Lower "),
        ("FLAGCX_SPIN_US", "20"),
    ]))
    .unwrap();
    assert_eq!(c.ipc_copier, IpcCopier::Lower);
    assert_eq!(c.spin, Some(Duration::from_micros(20)));
    let d = Config::from_lookup(lookup(&[("FLAGCX_SPIN_US", " ")])).unwrap();
    assert_eq!(
        (d.ipc_copier, d.spin),
        (IpcCopier::Auto, None),
        "blank is unset"
    );
    for (k, v) in [
        ("FLAGCX_P2P_IPC_COPIER", "upper"),
        ("FLAGCX_SPIN_US", "-1"),
        ("FLAGCX_SPIN_US", "10001"),
        ("FLAGCX_SPIN_US", "5us"),
        ("FLAGCX_P2P_HOST_DIRECT", "maybe"),
        ("FLAGCX_P2P_HOST_MAP_MAX", "lots"),
        ("FLAGCX_P2P_HOST_PIN_PIECE", "0"),
        ("FLAGCX_P2P_HOST_PIN_PIECE", "big"),
    ] {
        let e = Config::from_lookup(lookup(&[(k, v)])).unwrap_err();
        assert!(e.to_string().contains(k), "{k}={v}: {e}");
    }
    for c in [IpcCopier::Auto, IpcCopier::Sender, IpcCopier::Lower] {
        assert_eq!(IpcCopier::from_code(c.code()), Some(c));
    }
    assert_eq!(IpcCopier::from_code(3), None);
    let h = Config::from_lookup(lookup(&[
        ("FLAGCX_P2P_HOST_DIRECT", "OFF"),
        ("FLAGCX_P2P_HOST_MAP_MAX", "2G"),
        ("FLAGCX_P2P_HOST_PIN_PIECE", "64K"),
    ]))
    .unwrap();
    assert_eq!((h.host_direct, h.host_map_max), (HostDirect::Off, 2 << 30));
    assert_eq!(h.host_pin_piece, 64 << 10);
    assert_eq!(Config::default().host_pin_piece, 8 << 20);
    assert_eq!(Config::default().host_direct, HostDirect::Auto);
    for d in [HostDirect::Auto, HostDirect::On, HostDirect::Off] {
        assert_eq!(HostDirect::from_code(d.code()), Some(d));
    }
    assert_eq!(HostDirect::from_code(3), None);
    let s = Config::from_lookup(lookup(&[
        ("FLAGCX_P2P_STREAM", "on"),
        ("FLAGCX_P2P_STREAM_KERNEL", "off"),
    ]))
    .unwrap();
    assert_eq!(
        (s.streamed, s.stream_kernel),
        (HostDirect::On, HostDirect::Off)
    );
    assert_eq!(Config::default().stream_kernel, HostDirect::Auto);
    assert_eq!(Config::default().late_copy, HostDirect::Auto);
    let l = Config::from_lookup(lookup(&[("FLAGCX_P2P_LATE_COPY", "on")])).unwrap();
    assert_eq!(l.late_copy, HostDirect::On);
    let e = Config::from_lookup(lookup(&[("FLAGCX_P2P_LATE_COPY", "yes")])).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_P2P_LATE_COPY"), "{e}");
    let e = Config::from_lookup(lookup(&[("FLAGCX_P2P_STREAM_KERNEL", "sometimes")])).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_P2P_STREAM_KERNEL"), "{e}");
}

#[test]
fn ring_geometry_is_validated() {
    let mut c = Config::default();
    c.validate().unwrap();
    assert_eq!(c.slots(), 4);
    let names = |r: Result<()>, var: &str, value: &str| match r {
        Err(CommError::Config {
            name,
            value: v,
            reason,
        }) => {
            assert_eq!(name, var, "{reason}");
            assert_eq!(v, value);
        }
        other => panic!("expected a Config error naming {var}, got {other:?}"),
    };
    c.chunksize = 100;
    names(c.validate(), "FLAGCX_P2P_CHUNKSIZE", "100");
    c.chunksize = 1 << 20;
    c.buffsize = 1 << 20;
    // A one-slot ring cannot pipeline.
    names(c.validate(), "FLAGCX_P2P_BUFFSIZE", "1048576");
    c.buffsize = 2048 << 20;
    c.chunksize = 1 << 20;
    names(c.validate(), "FLAGCX_P2P_BUFFSIZE", "2147483648");
    c.buffsize = 32 << 20;
    assert_eq!(c.split, DEFAULT_SPLIT);
    for bad in [0, 65] {
        c.split = bad;
        names(c.validate(), "FLAGCX_P2P_SPLIT", &bad.to_string());
    }
    c.split = 64;
    c.validate().unwrap();
    c.eager_max = MAX_EAGER_MAX + 1;
    names(
        c.validate(),
        "FLAGCX_P2P_EAGER_MAX",
        &(MAX_EAGER_MAX + 1).to_string(),
    );
}

#[test]
fn reduce_check_is_on_unless_turned_off() {
    assert!(Config::from_lookup(lookup(&[])).unwrap().reduce_check);
    let off = Config::from_lookup(lookup(&[("FLAGCX_REDUCE_CHECK", "0")])).unwrap();
    assert!(!off.reduce_check);
    let e = Config::from_lookup(lookup(&[("FLAGCX_REDUCE_CHECK", "maybe")])).unwrap_err();
    assert!(e.to_string().contains("FLAGCX_REDUCE_CHECK"), "{e}");
}

#[test]
fn a_reduce_slice_is_a_byte_count_above_zero() {
    assert_eq!(Config::from_lookup(lookup(&[])).unwrap().reduce_slice, None);
    let c = Config::from_lookup(lookup(&[("FLAGCX_REDUCE_SLICE", "1M")])).unwrap();
    assert_eq!(c.reduce_slice, Some(1 << 20));
    for bad in ["0", "big"] {
        let e = Config::from_lookup(lookup(&[("FLAGCX_REDUCE_SLICE", bad)])).unwrap_err();
        assert!(e.to_string().contains("FLAGCX_REDUCE_SLICE"), "{e}");
    }
}

#[test]
fn a_process_is_launched_when_any_launchers_rank_and_size_are_set() {
    assert!(!RankEnv::launched_by(lookup(&[])));
    assert!(!RankEnv::launched_by(lookup(&[(
        "OMPI_COMM_WORLD_RANK",
        "1"
    )])));
    assert!(!RankEnv::launched_by(lookup(&[
        ("RANK", " "),
        ("WORLD_SIZE", "2")
    ])));
    for pair in [
        [("FLAGCX_RANK", "0"), ("FLAGCX_NRANKS", "2")],
        [("RANK", "1"), ("WORLD_SIZE", "2")],
        [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")],
        [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")],
    ] {
        assert!(RankEnv::launched_by(lookup(&pair)), "{pair:?}");
    }
}
