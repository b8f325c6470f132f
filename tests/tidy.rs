//! Tidy checks (rust-analyzer's habit): the docs and the code agree, and no file grows past
//! what one reader holds without saying why. Run with every `cargo xtask test`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// The source folders of the library, its tools and its vendors (not the tests).
fn source_dirs() -> Vec<PathBuf> {
    let r = root();
    let mut dirs = vec![r.join("src"), r.join("xtask/src")];
    for group in ["crates", "adaptors"] {
        for e in std::fs::read_dir(r.join(group)).expect(group).flatten() {
            dirs.push(e.path().join("src"));
        }
    }
    dirs
}

/// `FLAGCX_…` names in `text` (upper case, digits, underscores).
fn env_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("FLAGCX_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].trim_end_matches('_');
        if name.len() > "FLAGCX_".len() {
            out.insert(name.to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Every `FLAGCX_*` variable the code names is in the README's environment tables, and every
/// one there is still named by some code (library, tools or tests). The conformance suite's
/// child-process plumbing (`FLAGCX_CONFORMANCE_*`) is internal.
#[test]
fn environment_variables_match_the_readme() {
    let readme = read(&root().join("README.md"));
    let env_section = &readme[readme
        .find("## Environment")
        .expect("an Environment section")..];
    let documented = env_names(env_section);
    let mut in_code = BTreeSet::new();
    for dir in source_dirs() {
        for f in rust_files(&dir) {
            // String literals and constants only: doc comments mention names too.
            for line in read(&f).lines() {
                let code = line.trim_start();
                if code.starts_with("//") {
                    continue;
                }
                for n in env_names(code) {
                    if code.contains(&format!("\"{n}")) {
                        in_code.insert(n);
                    }
                }
            }
        }
    }
    in_code.retain(|n| !n.starts_with("FLAGCX_CONFORMANCE_"));
    let undocumented: Vec<_> = in_code.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "read in code but not in the README's tables: {undocumented:?}"
    );
    let mut anywhere = String::new();
    for dir in source_dirs().into_iter().chain([root().join("tests")]) {
        for f in rust_files(&dir) {
            anywhere.push_str(&read(&f));
        }
    }
    let stale: Vec<_> = documented
        .iter()
        .filter(|n| !anywhere.contains(&format!("\"{n}")))
        .collect();
    assert!(
        stale.is_empty(),
        "in the README but read nowhere: {stale:?}"
    );
}

/// The module table of `docs/architecture.md` names every file of `crates/flagcx-p2p/src`,
/// and no file that is gone.
#[test]
fn architecture_module_table_matches_the_p2p_crate() {
    let doc = read(&root().join("docs/architecture.md"));
    let table = &doc[doc.find("| module | what |").expect("the module table")..];
    let named: BTreeSet<String> = table
        .lines()
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cell = l.split('|').nth(1)?.trim();
            let name = cell.strip_prefix('`')?.split('`').next()?;
            name.ends_with(".rs").then(|| name.to_string())
        })
        .collect();
    let src = root().join("crates/flagcx-p2p/src");
    let files: BTreeSet<String> = rust_files(&src)
        .iter()
        .map(|p| {
            p.strip_prefix(&src)
                .expect("under src")
                .display()
                .to_string()
        })
        .collect();
    let missing: Vec<_> = files.difference(&named).collect();
    let gone: Vec<_> = named.difference(&files).collect();
    assert!(missing.is_empty(), "not in the module table: {missing:?}");
    assert!(gone.is_empty(), "in the module table but gone: {gone:?}");
}

/// Test names the reliability document cites (`name` in its tables; `a_{b, c}` stands for
/// `a_b` and `a_c`) exist as test functions (Rust, or Python in the package's tests).
#[test]
fn tests_cited_in_the_reliability_doc_exist() {
    let doc = read(&root().join("docs/reliability.md"));
    let mut code = String::new();
    for dir in [
        root().join("tests"),
        root().join("crates"),
        root().join("adaptors"),
    ] {
        for f in rust_files(&dir) {
            code.push_str(&read(&f));
        }
    }
    // The Python package's tests are Python functions: `def name(` reads as `fn name(`.
    for f in std::fs::read_dir(root().join("crates/flagcx-py/tests"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
    {
        code.push_str(&read(&f).replace("def ", "fn "));
    }
    let mut cited = BTreeSet::new();
    for line in doc.lines().filter(|l| l.starts_with('|')) {
        for (i, span) in line.split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            let names: Vec<String> = match span.split_once('{') {
                Some((head, tail)) => tail
                    .trim_end_matches('}')
                    .split(',')
                    .map(|t| format!("{head}{}", t.trim()))
                    .collect(),
                None => vec![span.to_string()],
            };
            for n in names {
                // A test name: snake case with at least three words, no path or call.
                let snake = n
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
                if snake && n.matches('_').count() >= 2 && !n.ends_with(".rs") {
                    cited.insert(n);
                }
            }
        }
    }
    assert!(cited.len() > 20, "found only {cited:?}");
    let absent: Vec<_> = cited
        .iter()
        .filter(|n| !code.contains(&format!("fn {n}(")) && !code.contains(&format!("fn {n}<")))
        .collect();
    assert!(
        absent.is_empty(),
        "cited in docs/reliability.md but not a function: {absent:?}"
    );
}

/// Above this many lines a source file must say why (a line containing `tidy: long file`).
const LONG_FILE: usize = 800;

#[test]
fn long_files_say_why() {
    let mut long = Vec::new();
    for dir in source_dirs().into_iter().chain([root().join("tests")]) {
        for f in rust_files(&dir) {
            let text = read(&f);
            let n = text.lines().count();
            if n > LONG_FILE && !text.contains("tidy: long file") {
                long.push(format!(
                    "{} ({n} lines)",
                    f.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "over {LONG_FILE} lines without a `tidy: long file` line saying why: {long:?}"
    );
}

/// A crate's import graph at the level of its top-level modules (a module and its submodules
/// are one node): which others each names in code — `use crate::…`, grouped
/// `use crate::{a, b}`, inline `crate::m::…`, and `super::m` from a top-level file — comments
/// left out (doc links name modules without importing them).
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let top = |f: &Path| -> Option<String> {
        let rel = f.strip_prefix(src).ok()?;
        let first = rel.components().next()?.as_os_str().to_str()?;
        let name = first.trim_end_matches(".rs");
        (!matches!(name, "lib" | "main")).then(|| name.to_string())
    };
    let files = rust_files(src);
    let tops: BTreeSet<String> = files.iter().filter_map(|f| top(f)).collect();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> =
        tops.iter().map(|t| (t.clone(), BTreeSet::new())).collect();
    for f in &files {
        let Some(me) = top(f) else { continue };
        let top_level = f.parent() == Some(src);
        for line in read(f).lines() {
            let code = line.split("//").next().unwrap_or_default();
            let mut names = Vec::new();
            let prefixes: &[&str] = if top_level {
                &["crate::", "super::"]
            } else {
                &["crate::"]
            };
            for prefix in prefixes {
                for (i, _) in code.match_indices(prefix) {
                    let rest = &code[i + prefix.len()..];
                    if let Some(group) = rest.strip_prefix('{') {
                        let inner = &group[..group.find('}').unwrap_or(group.len())];
                        names.extend(inner.split(',').map(|p| ident(p.trim())));
                    } else {
                        names.push(ident(rest));
                    }
                }
            }
            for n in names {
                if n != me && tops.contains(&n) {
                    graph.get_mut(&me).expect("a node").insert(n);
                }
            }
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v] {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = BTreeSet::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                c.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                t.out.push(c);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_import_circles() {
    let r = root();
    let mut crates = vec![r.join("src"), r.join("xtask/src")];
    for group in ["crates", "adaptors"] {
        for e in std::fs::read_dir(r.join(group)).expect(group).flatten() {
            crates.push(e.path().join("src"));
        }
    }
    let mut bad = Vec::new();
    for src in crates {
        let g = module_graph(&src);
        let name = src.strip_prefix(&r).unwrap().display().to_string();
        for c in circles(&g) {
            let edges: Vec<String> = c
                .iter()
                .flat_map(|a| {
                    g[a].iter()
                        .filter(|b| c.contains(*b))
                        .map(move |b| format!("{a} -> {b}"))
                })
                .collect();
            bad.push(format!("{name}: {c:?} through {edges:?}"));
        }
    }
    assert!(bad.is_empty(), "import circles: {bad:#?}");
}

/// `flagcx-p2p`'s floors, lowest first (`docs/architecture.md`, "Layers"): a module names only
/// modules on its own floor or below. Every module of the crate must be placed.
const P2P_FLOORS: &[&[&str]] = &[
    &[
        "error", "numa", "posting", "kept", "ucx", "wire", "shm", "scratch", "standin",
    ],
    &["bootstrap", "channel", "config", "peer", "slots"],
    &["op", "request", "profile", "ipccache", "watermark"],
    &["shared", "guard"],
    &["link"],
    &["engine"],
    &["transport"],
    &["comm"],
    &["join", "port", "drive", "collectives", "group", "setup"],
    &["reduction", "launch"],
];

#[test]
fn p2p_modules_keep_their_floors() {
    let g = module_graph(&root().join("crates/flagcx-p2p/src"));
    let floor = |m: &str| P2P_FLOORS.iter().position(|f| f.contains(&m));
    let unplaced: Vec<&String> = g.keys().filter(|m| floor(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "flagcx-p2p modules on no floor of P2P_FLOORS: {unplaced:?}"
    );
    let mut up = Vec::new();
    for (a, names) in &g {
        for b in names {
            if floor(b) > floor(a) {
                up.push(format!(
                    "{a} (floor {:?}) -> {b} (floor {:?})",
                    floor(a),
                    floor(b)
                ));
            }
        }
    }
    assert!(up.is_empty(), "a lower module names a higher one: {up:#?}");
    // The graph sees what the code names (`use`, inline paths): the transports extend the
    // engine, and `Comm`'s posting side (`comm/`) names the late-copy transport; no transport
    // names `Comm`.
    assert!(g["transport"].contains("engine") && g["comm"].contains("transport"));
    assert!(!g["transport"].contains("comm"), "a transport names `Comm`");
}

/// The engine drives the transports through `engine::Protocol` and the registry
/// (`transport::protocols`), naming none of them: no module below `transport` in
/// [`P2P_FLOORS`] calls a function that only `transport/` defines (methods the transports add
/// to `Engine` are invisible to the import graph, which sees paths). `Comm`'s posting side —
/// the posting threads' paths (eager, IPC, network, late copies, stream-ordered) — lives above
/// the transports, in `comm/`, where it may name them.
#[test]
fn lower_floors_call_no_transport_function() {
    let src = root().join("crates/flagcx-p2p/src");
    let fn_names = |files: &[PathBuf]| -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for f in files {
            for line in read(f).lines() {
                let code = line.split("//").next().unwrap_or_default();
                for (i, _) in code.match_indices("fn ") {
                    let name: String = code[i + 3..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        names.insert(name);
                    }
                }
            }
        }
        names
    };
    let all = rust_files(&src);
    let (transport, rest): (Vec<PathBuf>, Vec<PathBuf>) = all
        .into_iter()
        .partition(|f| f.starts_with(src.join("transport")));
    let elsewhere = fn_names(&rest);
    let theirs: BTreeSet<String> = fn_names(&transport)
        .difference(&elsewhere)
        .cloned()
        .collect();
    assert!(
        theirs.contains("progress_late") && theirs.contains("abandon_chunks"),
        "the transports' own functions are found: {theirs:?}"
    );
    let floor = |m: &str| P2P_FLOORS.iter().position(|f| f.contains(&m));
    let transport_floor = floor("transport").expect("placed");
    let mut calls = Vec::new();
    for f in &rest {
        let rel = f.strip_prefix(&src).expect("inside");
        let module = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|m| m.trim_end_matches(".rs").to_string())
            .unwrap_or_default();
        if floor(&module).is_none_or(|fl| fl >= transport_floor) {
            continue;
        }
        for (n, line) in read(f).lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            for name in &theirs {
                if code.contains(&format!(".{name}(")) || code.contains(&format!("::{name}(")) {
                    calls.push(format!("{}:{}: {name}", rel.display(), n + 1));
                }
            }
        }
    }
    assert!(
        calls.is_empty(),
        "modules below `transport` call the transports' functions by name: {calls:#?}"
    );
}

#[test]
fn the_import_graph_reads_grouped_and_inline_paths() {
    let dir = std::env::temp_dir().join(format!("flagcx-tidy-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("c")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a; mod b; mod c;").unwrap();
    std::fs::write(
        dir.join("a.rs"),
        "use crate::{b::X, c};\n// crate::d in a comment\n",
    )
    .unwrap();
    std::fs::write(dir.join("b.rs"), "fn f() { super::c::g(); }").unwrap();
    std::fs::write(dir.join("c/mod.rs"), "fn g() { let _ = crate::a::Y; }").unwrap();
    let g = module_graph(&dir);
    assert_eq!(g["a"], ["b", "c"].map(String::from).into());
    assert_eq!(g["b"], ["c"].map(String::from).into());
    assert_eq!(g["c"], ["a"].map(String::from).into());
    assert_eq!(circles(&g), vec![["a", "b", "c"].map(String::from).into()]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The delegating adaptors (the facade's `Adaptor`, the tests' `FaultyAdaptor`) forward every
/// method of `DeviceAdaptor`: a method with a default body that a delegator forgets silently
/// answers with the default for every adaptor behind it (it happened to `host_pin`, twice).
#[test]
fn delegating_adaptors_forward_every_method() {
    let names = |text: &str| -> BTreeSet<String> {
        text.lines()
            .filter_map(|l| {
                let l = l.trim_start();
                let rest = l
                    .strip_prefix("unsafe fn ")
                    .or_else(|| l.strip_prefix("fn "))?;
                Some(rest.split(['(', '<']).next()?.to_string())
            })
            .collect()
    };
    let contract = read(&root().join("crates/flagcx-adaptor/src/adaptor.rs"));
    let trait_body = &contract[contract.find("pub trait DeviceAdaptor").expect("the trait")..];
    let want = names(trait_body);
    // The delegating implementations: the facade's dispatch and the fault injector.
    for (file, header) in [
        ("src/dispatch.rs", "impl DeviceAdaptor for Adaptor"),
        (
            "crates/flagcx-adaptor/src/testing.rs",
            "impl<A: DeviceAdaptor> DeviceAdaptor for FaultyAdaptor<A>",
        ),
    ] {
        let text = read(&root().join(file));
        let body = &text[text
            .find(header)
            .unwrap_or_else(|| panic!("{header} in {file}"))..];
        let have = names(body);
        let missing: Vec<_> = want.difference(&have).collect();
        assert!(missing.is_empty(), "{file} does not forward {missing:?}");
    }
}
