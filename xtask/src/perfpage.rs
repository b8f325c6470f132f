//! `cargo xtask perf-page`: `docs/performance.md` generated from committed data.
//!
//! - `docs/perf/runs/*.json`: one file per run — when, where, which commit, the command that
//!   reproduces it, the peer and ceiling it was measured beside, and its rows. A row names its
//!   test, ranks and bytes and holds one value per round: our time (`ours_us`), the peer's
//!   (`peer_us`), the ceiling's (`ceiling_us`); where a run kept only ratios (runs before this
//!   format), `ratio` holds them per round.
//! - `docs/perf/targets.json`: the open issues' targets, each a rule over the rows it selects
//!   from one run.
//! - `docs/perf/intro.md` and `docs/perf/outro.md`: the page's hand-written text (how to read
//!   it, how to reproduce it, `flagcx-perf`'s output).
//!
//! **The one rule for verdicts**: a row's value is the median over its rounds of a per-round
//! quantity — the reference's time ÷ ours (a ratio: above 1 we are faster), our time, or our
//! time − the reference's (added µs) — compared with the target's bound. A target is met where
//! every row it selects is met. Nothing on the page is typed by hand but the text files above
//! and each target's `bound` note (what limits a missed row, measured).
//!
//! `--check` (run by `cargo xtask ci`) fails where the committed page differs from what the
//! data generates.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use crate::{root, Result};

const PAGE: &str = "docs/performance.md";

/// One run file.
struct Run {
    id: String,
    meta: Value,
    rows: Vec<Value>,
}

fn load_runs(dir: &Path) -> Result<BTreeMap<String, Run>> {
    let mut runs = BTreeMap::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    names.sort();
    for p in names {
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
        let id = p
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        for key in ["date", "host", "commit", "command"] {
            if !v[key].is_string() {
                return Err(format!("{}: no \"{key}\" (a string)", p.display()));
            }
        }
        let rows = v["rows"]
            .as_array()
            .ok_or_else(|| format!("{}: no \"rows\" array", p.display()))?
            .clone();
        runs.insert(id.clone(), Run { id, meta: v, rows });
    }
    Ok(runs)
}

fn nums(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// The rule of a target.
#[derive(Clone, Copy)]
enum Rule {
    /// reference ÷ ours ≥ bound.
    RatioAtLeast(f64),
    /// ours ≤ bound µs.
    TimeAtMost(f64),
    /// ours − reference ≤ bound µs.
    AddedAtMost(f64),
}

impl Rule {
    fn parse(v: &Value) -> Option<Rule> {
        let o = v.as_object()?;
        let (k, x) = o.iter().next()?;
        let x = x.as_f64()?;
        match k.as_str() {
            "ratio_at_least" => Some(Rule::RatioAtLeast(x)),
            "time_at_most" => Some(Rule::TimeAtMost(x)),
            "added_at_most" => Some(Rule::AddedAtMost(x)),
            _ => None,
        }
    }

    fn describe(self, against: &str, unit: &str) -> String {
        match self {
            Rule::RatioAtLeast(b) => format!("{against}'s time ÷ ours, per round, ≥ {b}"),
            Rule::TimeAtMost(b) => format!("our time ≤ {b} {unit}"),
            Rule::AddedAtMost(b) => format!("our time − {against}'s, per round, ≤ {b} {unit}"),
        }
    }

    /// Per-round values of the rule's quantity for `row`, compared against `against`
    /// ("peer" or "ceiling").
    fn rounds(self, row: &Value, against: &str, unit: &str) -> Vec<f64> {
        let ours = nums(&row[format!("ours_{unit}")]);
        let reference = nums(&row[format!("{against}_{unit}")]);
        match self {
            Rule::RatioAtLeast(_) => {
                let given = nums(&row["ratio"]);
                if !given.is_empty() {
                    return given;
                }
                ours.iter()
                    .zip(&reference)
                    .filter(|(o, _)| **o > 0.0)
                    .map(|(o, r)| r / o)
                    .collect()
            }
            Rule::TimeAtMost(_) => ours,
            Rule::AddedAtMost(_) => ours.iter().zip(&reference).map(|(o, r)| o - r).collect(),
        }
    }

    fn met(self, x: f64) -> bool {
        match self {
            Rule::RatioAtLeast(b) => x >= b,
            Rule::TimeAtMost(b) | Rule::AddedAtMost(b) => x <= b,
        }
    }
}

fn size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (u, name) in UNITS {
        if bytes >= u && bytes.is_multiple_of(u) {
            return format!("{} {name}", bytes / u);
        }
    }
    format!("{bytes} B")
}

fn fmt_num(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// `median [lo–hi]` of a round list, or `–`.
fn cell(v: &[f64]) -> String {
    match median(v) {
        None => "–".into(),
        Some(m) if v.len() == 1 => fmt_num(m),
        Some(m) => {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{} [{}–{}]", fmt_num(m), fmt_num(lo), fmt_num(hi))
        }
    }
}

/// A target's unit of time: the field suffix (`us`, `s`) and how the page shows it.
fn unit(target: &Value) -> (&str, &str) {
    match target["unit"].as_str().unwrap_or("us") {
        "s" => ("s", "s"),
        "ms" => ("ms", "ms"),
        _ => ("us", "µs"),
    }
}

/// What a run calls a reference (`labels` in its file), e.g. "Open MPI" for `peer_us`.
fn label(run: &Run, against: &str) -> String {
    run.meta["labels"][against]
        .as_str()
        .unwrap_or(against)
        .to_string()
}

fn selects(target: &Value, row: &Value) -> bool {
    let sel_ok = target["select"]
        .as_object()
        .is_none_or(|s| s.iter().all(|(k, v)| &row[k] == v));
    let bytes = row["bytes"].as_u64().unwrap_or(0);
    let range = nums(&target["bytes"]);
    let in_range = match range.as_slice() {
        [lo, hi] => (*lo as u64..=*hi as u64).contains(&bytes),
        _ => true,
    };
    sel_ok && in_range
}

#[derive(Debug)]
struct Verdict {
    text: String,
    table: String,
}

fn judge(target: &Value, run: &Run) -> Result<Verdict> {
    let id = target["id"].as_str().unwrap_or("?");
    let rule = Rule::parse(&target["rule"]).ok_or_else(|| {
        format!("target {id}: \"rule\" must be one of ratio_at_least, time_at_most, added_at_most")
    })?;
    let against = target["against"].as_str().unwrap_or("peer");
    let label = label(run, against);
    let (unit, shown) = unit(target);
    let mut rows: Vec<&Value> = run.rows.iter().filter(|r| selects(target, r)).collect();
    rows.sort_by_key(|r| {
        (
            r["test"].as_str().unwrap_or_default().to_string(),
            r["ranks"].as_u64().unwrap_or(0),
            r["bytes"].as_u64().unwrap_or(0),
        )
    });
    if rows.is_empty() {
        return Err(format!("target {id}: run {} has no row it selects", run.id));
    }
    let quantity = match rule {
        Rule::RatioAtLeast(_) => format!("{label} ÷ ours"),
        Rule::TimeAtMost(_) => format!("ours {shown}"),
        Rule::AddedAtMost(_) => format!("added {shown}"),
    };
    let mut table = format!(
        "| test | ranks | bytes | ours {shown} | {label} {shown} | {quantity} | verdict |\n\
         |---|---|---|---|---|---|---|\n"
    );
    let mut missed = Vec::new();
    // Rows of several tests or rank counts: a missed row is named by all three.
    let multi = rows
        .iter()
        .any(|r| r["test"] != rows[0]["test"] || r["ranks"] != rows[0]["ranks"]);
    for r in &rows {
        let bytes = r["bytes"].as_u64().unwrap_or(0);
        let q = rule.rounds(r, against, unit);
        let m = median(&q).ok_or_else(|| {
            format!(
                "target {id}: the {bytes}-byte row of run {} has no values for the rule",
                run.id
            )
        })?;
        let ok = rule.met(m);
        if !ok {
            missed.push(if multi {
                let ranks = r["ranks"]
                    .as_u64()
                    .map_or_else(String::new, |n| format!(" ({n} ranks)"));
                format!(
                    "{}{ranks} {}",
                    r["test"].as_str().unwrap_or("–"),
                    size(bytes)
                )
            } else {
                size(bytes)
            });
        }
        writeln!(
            table,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r["test"].as_str().unwrap_or("–"),
            r["ranks"]
                .as_u64()
                .map_or_else(|| "–".into(), |n| n.to_string()),
            size(bytes),
            cell(&nums(&r[format!("ours_{unit}")])),
            cell(&nums(&r[format!("{against}_{unit}")])),
            cell(&q),
            if ok { "met" } else { "**missed**" }
        )
        .expect("writing to a String");
    }
    let text = if missed.is_empty() {
        "met".to_string()
    } else if missed.len() == rows.len() {
        "**missed**".to_string()
    } else {
        format!("**missed** at {}", missed.join(", "))
    };
    Ok(Verdict { text, table })
}

/// The page generated from `docs/perf`.
pub fn generate() -> Result<String> {
    let dir = root().join("docs/perf");
    let runs = load_runs(&dir.join("runs"))?;
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name)).map_err(|e| format!("docs/perf/{name}: {e}"))
    };
    let targets: Value = serde_json::from_str(&read("targets.json")?)
        .map_err(|e| format!("docs/perf/targets.json: {e}"))?;
    let targets = targets
        .as_array()
        .ok_or("docs/perf/targets.json: not an array")?;
    let mut glance = String::from("| issue | target | verdict | run |\n|---|---|---|---|\n");
    let mut sections = String::new();
    for t in targets {
        let id = t["id"].as_str().ok_or("a target without \"id\"")?;
        let title = t["title"].as_str().unwrap_or(id);
        let issue = t["issue"]
            .as_u64()
            .map_or_else(|| "—".to_string(), |n| format!("#{n}"));
        let Some(run_id) = t["run"].as_str() else {
            // A target no run has measured yet: said so, with why.
            let why = t["bound"].as_str().unwrap_or("not measured yet");
            writeln!(glance, "| {issue} | [{title}](#{id}) | no data | — |")
                .expect("writing to a String");
            write!(
                sections,
                "\n<a id=\"{id}\"></a>\n### {issue}: {title}\n\nNo run yet. {why}\n"
            )
            .expect("writing to a String");
            continue;
        };
        let run = runs
            .get(run_id)
            .ok_or_else(|| format!("target {id}: no run docs/perf/runs/{run_id}.json"))?;
        let v = judge(t, run)?;
        let rule = Rule::parse(&t["rule"]).expect("checked by judge");
        let against = t["against"].as_str().unwrap_or("peer");
        let (_, shown) = unit(t);
        let m = &run.meta;
        let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
        writeln!(
            glance,
            "| {issue} | [{title}](#{id}) | {} | {}, {}, `{}` |",
            v.text,
            s("date"),
            s("host"),
            s("commit")
        )
        .expect("writing to a String");
        write!(
            sections,
            "\n<a id=\"{id}\"></a>\n### {issue}: {title}\n\nRule: the median over rounds of {}. \
             Verdict: {}.\n\n",
            rule.describe(&label(run, against), shown),
            v.text
        )
        .expect("writing to a String");
        write!(
            sections,
            "Run `{}` — {}, {}, commit `{}`: `{}`",
            run.id,
            s("date"),
            s("host"),
            s("commit"),
            s("command")
        )
        .expect("writing to a String");
        if let Some(refs) = m["references"].as_object() {
            for (k, x) in refs {
                let x = x.as_str().unwrap_or_default();
                write!(sections, "; {}: {x}", label(run, k)).expect("writing to a String");
            }
        }
        if let Some(x) = m["source"].as_str() {
            write!(sections, "; source: {x}").expect("writing to a String");
        }
        sections.push_str(".\n\n");
        sections.push_str(&v.table);
        if let Some(b) = t["bound"].as_str() {
            writeln!(sections, "\n{b}").expect("writing to a String");
        }
    }
    let mut page = String::new();
    page.push_str(&read("intro.md")?);
    page.push_str("\n## The targets at a glance\n\n");
    page.push_str(&glance);
    page.push_str("\n## Each target's rows\n");
    page.push_str(&sections);
    page.push('\n');
    page.push_str(&read("outro.md")?);
    Ok(page)
}

/// Writes the page, or with `check` fails where the committed one differs.
pub fn perf_page(check: bool) -> Result {
    let page = generate()?;
    let path = root().join(PAGE);
    if check {
        let now = std::fs::read_to_string(&path).unwrap_or_default();
        if now != page {
            return Err(format!(
                "{PAGE} is not what docs/perf generates: run `cargo xtask perf-page` and commit it"
            ));
        }
        println!("xtask: {PAGE} matches docs/perf");
        return Ok(());
    }
    std::fs::write(&path, page).map_err(|e| format!("{PAGE}: {e}"))?;
    println!("xtask: wrote {PAGE} from docs/perf");
    Ok(())
}

fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(cmd).args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// This machine in a few words: CPUs and the CPU model (`/proc/cpuinfo`).
pub fn this_host() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cpus} CPUs ({model})")
}

/// The commit the working tree is at, `+dirty` where it has changes.
fn this_commit() -> String {
    let head = output("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "?".into());
    let dirty = output("git", &["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|s| !s.is_empty());
    if dirty {
        format!("{head}+dirty")
    } else {
        head
    }
}

/// Writes `docs/perf/runs/NAME.json`: this run's rows with when, where and what ran them.
pub fn record(name: &str, command: &str, extra: &[(&str, Value)], rows: Vec<Value>) -> Result {
    let date = output("date", &["-u", "+%F"]).unwrap_or_default();
    let mut meta = serde_json::Map::new();
    meta.insert("date".into(), date.into());
    meta.insert("host".into(), this_host().into());
    meta.insert("commit".into(), this_commit().into());
    meta.insert("command".into(), command.into());
    for (k, v) in extra {
        meta.insert((*k).into(), v.clone());
    }
    meta.insert("rows".into(), Value::Array(rows));
    let dir = root().join("docs/perf/runs");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{name}.json"));
    let text = serde_json::to_string_pretty(&Value::Object(meta)).map_err(|e| e.to_string())?;
    std::fs::write(&path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    println!("xtask: recorded {}", path.display());
    Ok(())
}

/// Open MPI's version line (`mpirun --version`), for a run's `peer`.
pub fn mpi_version() -> String {
    output("mpirun", &["--version"])
        .and_then(|v| v.lines().next().map(str::to_string))
        .unwrap_or_else(|| "Open MPI".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(rows: Value) -> Run {
        Run {
            id: "r".into(),
            meta: json!({"labels": {"peer": "Open MPI"}}),
            rows: rows.as_array().unwrap().clone(),
        }
    }

    #[test]
    fn verdicts_follow_the_median_of_rounds() {
        let r = run(json!([
            {"test": "t", "bytes": 8, "ours_us": [1.0, 1.0, 3.0], "peer_us": [1.1, 1.2, 1.0]},
            {"test": "t", "bytes": 64, "ours_us": [2.0, 2.0, 2.0], "peer_us": [1.0, 1.0, 5.0]},
            {"test": "u", "bytes": 64, "ours_us": [9.0], "peer_us": [1.0]},
        ]));
        let t = json!({"id": "x", "run": "r", "select": {"test": "t"},
                       "rule": {"ratio_at_least": 1.0}});
        let v = judge(&t, &r).unwrap();
        // 8 B: per-round ratios 1.1, 1.2, 0.33: median 1.1, met; 64 B: 0.5, 0.5, 2.5: missed.
        assert_eq!(v.text, "**missed** at 64 B");
        assert!(v.table.contains(
            "| t | – | 8 B | 1.00 [1.00–3.00] | 1.10 [1.00–1.20] | 1.10 [0.33–1.20] | met |"
        ));
        assert!(v.table.contains("Open MPI ÷ ours"));
        let t = json!({"id": "x", "run": "r", "select": {"test": "t"}, "bytes": [8, 8],
                       "rule": {"ratio_at_least": 1.0}});
        assert_eq!(judge(&t, &r).unwrap().text, "met");
        let t = json!({"id": "x", "run": "r", "select": {"test": "t"},
                       "rule": {"added_at_most": 0.5}});
        assert_eq!(judge(&t, &r).unwrap().text, "**missed** at 64 B");
        let t = json!({"id": "x", "run": "r", "select": {"test": "u"},
                       "rule": {"time_at_most": 8}});
        assert_eq!(judge(&t, &r).unwrap().text, "**missed**");
    }

    #[test]
    fn given_ratios_and_bad_targets() {
        let r = run(json!([{"test": "t", "bytes": 1024, "ratio": [0.8, 0.95]}]));
        let t = json!({"id": "x", "run": "r", "against": "ceiling",
                       "rule": {"ratio_at_least": 0.85}});
        // Median of two rounds: their mean, 0.875.
        assert_eq!(judge(&t, &r).unwrap().text, "met");
        let bad = json!({"id": "x", "run": "r", "rule": {"faster": 1}});
        assert!(judge(&bad, &r).unwrap_err().contains("rule"));
        let none = json!({"id": "x", "run": "r", "select": {"test": "v"},
                          "rule": {"ratio_at_least": 1}});
        assert!(judge(&none, &r).unwrap_err().contains("no row"));
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(size(8), "8 B");
        assert_eq!(size(4096), "4 KiB");
        assert_eq!(size(3 << 20), "3 MiB");
        assert_eq!(size(1000), "1000 B");
    }
}
