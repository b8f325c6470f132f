//! `--plot FILE`: bus bandwidth and the ceiling against message size, log-log, with labelled
//! axes and a legend — SVG, or PNG when the name ends in `.png`.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

type Error = Box<dyn std::error::Error>;

/// Where TrueType fonts live on Linux distributions.
const FONT_DIRS: [&str; 3] = [
    "/usr/share/fonts",
    "/usr/local/share/fonts",
    "/usr/X11R6/lib/X11/fonts",
];

/// Fonts tried first, in order; then any `*Sans*.ttf`, then any `.ttf`.
const PREFERRED: [&str; 3] = [
    "DejaVuSans.ttf",
    "LiberationSans-Regular.ttf",
    "NotoSans-Regular.ttf",
];

/// Draws `rows` (bytes, bus bandwidth GB/s, ceiling GB/s) to `path`.
pub fn draw(path: &Path, title: &str, rows: &[(usize, f64, f64)]) -> Result<(), Error> {
    register_font()?;
    let png = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    let size = (960, 560);
    if png {
        chart(
            BitMapBackend::new(path, size).into_drawing_area(),
            title,
            rows,
        )
    } else {
        chart(SVGBackend::new(path, size).into_drawing_area(), title, rows)
    }
}

fn chart<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    rows: &[(usize, f64, f64)],
) -> Result<(), Error> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| -> Error { e.to_string().into() };
    let positive = |v: f64| v > 0.0 && v.is_finite();
    let x_min = rows.iter().map(|r| r.0).min().unwrap_or(1).max(1) as f64;
    let x_max = (rows.iter().map(|r| r.0).max().unwrap_or(2) as f64).max(x_min * 2.0);
    let ys = rows
        .iter()
        .flat_map(|r| [r.1, r.2])
        .filter(|v| positive(*v));
    let y_min = ys.clone().fold(f64::MAX, f64::min);
    let y_max = ys.fold(0.0, f64::max);
    let (y_min, y_max) = if y_max > 0.0 {
        (y_min / 2.0, y_max * 2.0)
    } else {
        (0.01, 1.0)
    };
    root.fill(&WHITE).map_err(e)?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d((x_min..x_max).log_scale(), (y_min..y_max).log_scale())
        .map_err(e)?;
    c.configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("bandwidth (GB/s)")
        .x_label_formatter(&|x| human(*x))
        .y_label_formatter(&|y| match *y {
            y if y >= 10.0 => format!("{y:.0}"),
            y if y >= 0.01 => format!("{y:.2}"),
            y => format!("{y:.0e}"),
        })
        .draw()
        .map_err(e)?;
    let ours = RGBColor(31, 95, 191);
    let ceiling = RGBColor(120, 120, 120);
    for (label, color, pick) in [
        ("flagcx-rs bus bandwidth", ours, 1usize),
        ("ceiling (bare copy, same traffic pattern)", ceiling, 2),
    ] {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .map(|r| (r.0 as f64, if pick == 1 { r.1 } else { r.2 }))
            .filter(|p| positive(p.1))
            .collect();
        c.draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(e)?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

/// `8`, `64K`, `16M`, `1G`.
fn human(b: f64) -> String {
    let b = b.round() as u64;
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// Whether a font for the plot's labels is there (registering it on the way).
pub fn check_font() -> Result<(), Error> {
    register_font()
}

/// Registers a system TrueType font as "sans-serif" once: plotters lays text out with it for
/// both backends. None found is an error that says what to install.
fn register_font() -> Result<(), Error> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let path = find_font().ok_or_else(|| {
            format!(
                "--plot needs a TrueType font and none was found under {}: install one \
                 (Debian/Ubuntu: apt-get install fonts-dejavu-core)",
                FONT_DIRS.join(", ")
            )
        })?;
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Plotters keeps fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{}: not a usable TrueType font", path.display()))
    })
    .clone()
    .map_err(Into::into)
}

fn find_font() -> Option<std::path::PathBuf> {
    let mut all = Vec::new();
    for dir in FONT_DIRS {
        collect_ttf(Path::new(dir), &mut all, 0);
    }
    let name = |p: &std::path::PathBuf| {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    PREFERRED
        .iter()
        .find_map(|want| all.iter().find(|p| name(p) == *want))
        .or_else(|| all.iter().find(|p| name(p).contains("Sans")))
        .or_else(|| all.first())
        .cloned()
}

fn collect_ttf(dir: &Path, out: &mut Vec<std::path::PathBuf>, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() && depth < 6 {
            collect_ttf(&p, out, depth + 1);
        } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("ttf")) {
            out.push(p);
        }
    }
}
