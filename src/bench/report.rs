//! Reports: a table for people, one JSON object per line for scripts, latency CDF plots.

use std::io::Write;
use std::path::Path;

use plotters::prelude::*;

use crate::bench::{BenchError, Sample};

/// Print the table header.
pub fn print_header(out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>5} {:<18} {:<9} {:>5} {:>4} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7} {:>11} {:>8} {:>8} {:>8}",
        "round",
        "engine",
        "workload",
        "bs",
        "qd",
        "IOPS",
        "mean us",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "cpu s",
        "IOPS/cpu-s",
        "lat/fio",
        "IOPS/fio",
        "lat/psync"
    )
}

/// Print one table row.
pub fn print_row(out: &mut impl Write, s: &Sample) -> std::io::Result<()> {
    let round = s.round.map_or("med".to_string(), |r| r.to_string());
    let ratio = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or_default();
    writeln!(
        out,
        "{:>5} {:<18} {:<9} {:>5} {:>4} {:>10.0} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>7.2} {:>11.0} {:>8} {:>8} {:>8}",
        round,
        s.engine,
        s.workload,
        human_bytes(s.bs.into()),
        s.qd,
        s.iops,
        s.lat_us_mean,
        s.lat_us_p50,
        s.lat_us_p99,
        s.lat_us_p999,
        s.cpu_s,
        s.iops_per_cpu_s,
        ratio(s.ratio_vs_fio),
        ratio(s.iops_ratio_vs_fio),
        ratio(s.ratio_vs_fio_psync)
    )
}

/// Print a sample (or any report line) as one JSON line.
pub fn print_json(out: &mut impl Write, s: &impl serde::Serialize) -> std::io::Result<()> {
    let line = serde_json::to_string(s).map_err(std::io::Error::other)?;
    writeln!(out, "{line}")
}

/// `4096` → `4k`, `1 << 30` → `1g`.
pub fn human_bytes(b: u64) -> String {
    if b >= 1 << 30 && b % (1 << 30) == 0 {
        format!("{}g", b >> 30)
    } else if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{}m", b >> 20)
    } else if b >= 1024 && b % 1024 == 0 {
        format!("{}k", b >> 10)
    } else {
        b.to_string()
    }
}

/// Parse `4k`, `128K`, `1m`, `512` into bytes.
pub fn parse_bytes(s: &str) -> Result<u32, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = match t.strip_suffix(['k', 'm', 'g']) {
        Some(n) => (
            n,
            match t.chars().last() {
                Some('k') => 1u64 << 10,
                Some('m') => 1 << 20,
                _ => 1 << 30,
            },
        ),
        None => (t.as_str(), 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size like 4096, 4k or 1m"))?;
    n.checked_mul(mul)
        .and_then(|v| u32::try_from(v).ok())
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("size '{s}' must be at least 1 byte and below 4 GiB"))
}

const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

fn ensure_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The font is compiled in; registration only fails on a corrupt file, caught by tests.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Plot latency CDFs (x: latency µs, log scale; y: fraction of requests) of `samples` into
/// `path` (PNG or SVG by extension).
pub fn plot_cdf(path: &Path, title: &str, samples: &[&Sample]) -> Result<(), BenchError> {
    ensure_font();
    let plot_err = |e: String| BenchError::Setup(format!("plotting {}: {e}", path.display()));
    let series: Vec<&Sample> = samples
        .iter()
        .copied()
        .filter(|s| !s.cdf.is_empty())
        .collect();
    if series.is_empty() {
        return Err(plot_err("no latency data to plot".into()));
    }
    let lo = series
        .iter()
        .flat_map(|s| s.cdf.iter().map(|p| p.1))
        .fold(f64::INFINITY, f64::min)
        .max(0.01);
    let hi = series
        .iter()
        .map(|s| s.lat_us_p999.max(s.lat_us_p99))
        .fold(0.0, f64::max)
        .max(lo * 2.0);
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => draw_cdf(
            SVGBackend::new(path, (900, 560)).into_drawing_area(),
            title,
            &series,
            lo,
            hi,
        ),
        _ => draw_cdf(
            BitMapBackend::new(path, (900, 560)).into_drawing_area(),
            title,
            &series,
            lo,
            hi,
        ),
    }
    .map_err(plot_err)
}

fn draw_cdf<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    series: &[&Sample],
    lo: f64,
    hi: f64,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("latency (us, log scale)")
        .y_desc("fraction of requests")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = s
            .cdf
            .iter()
            .map(|&(q, us)| (us.clamp(lo * 0.9, hi * 1.1), q))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(format!("{} (mean {:.1} us)", s.engine, s.lat_us_mean))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
/// Plot lines (x, y) of named series into `path` (PNG or SVG by extension), both axes linear
/// from 0: throughput against threads, for instance.
pub fn plot_lines(
    path: &Path,
    title: &str,
    axes: (&str, &str),
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), BenchError> {
    ensure_font();
    let plot_err = |e: String| BenchError::Setup(format!("plotting {}: {e}", path.display()));
    let pts = series.iter().flat_map(|s| s.1.iter());
    let (xmax, ymax) = pts.fold((0.0f64, 0.0f64), |(x, y), p| (x.max(p.0), y.max(p.1)));
    if xmax <= 0.0 || ymax <= 0.0 {
        return Err(plot_err("no points to plot".into()));
    }
    let ranges = (xmax * 1.05, ymax * 1.1);
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => draw_lines(
            SVGBackend::new(path, (900, 560)).into_drawing_area(),
            title,
            axes,
            series,
            ranges,
        ),
        _ => draw_lines(
            BitMapBackend::new(path, (900, 560)).into_drawing_area(),
            title,
            axes,
            series,
            ranges,
        ),
    }
    .map_err(plot_err)
}

fn draw_lines<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    axes: (&str, &str),
    series: &[(String, Vec<(f64, f64)>)],
    (xmax, ymax): (f64, f64),
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(|e| e.to_string())?;
    let short = |v: &f64| match v.abs() {
        a if a >= 1e6 => format!("{:.1}M", v / 1e6),
        a if a >= 1e3 => format!("{:.0}k", v / 1e3),
        _ => format!("{v:.1}"),
    };
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .x_labels(((xmax as usize) + 1).min(17))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&short)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_bytes("4k").unwrap(), 4096);
        assert_eq!(parse_bytes("1M").unwrap(), 1 << 20);
        assert_eq!(parse_bytes("512").unwrap(), 512);
        assert!(parse_bytes("4q").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("8g").is_err());
        assert_eq!(human_bytes(4096), "4k");
        assert_eq!(human_bytes(1 << 20), "1m");
        assert_eq!(human_bytes(1000), "1000");
    }

    #[test]
    fn cdf_plot_writes_png_and_svg() {
        let s = Sample {
            engine: "lbio".into(),
            lat_us_mean: 15.0,
            lat_us_p99: 30.0,
            lat_us_p999: 40.0,
            cdf: vec![(0.0, 10.0), (0.5, 15.0), (0.99, 30.0), (1.0, 40.0)],
            ..Sample::default()
        };
        let dir = std::env::temp_dir().join(format!("aios-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["cdf.png", "cdf.svg"] {
            let p = dir.join(name);
            plot_cdf(&p, "test", &[&s]).unwrap();
            let bytes = std::fs::read(&p).unwrap();
            assert!(bytes.len() > 1000, "{name} is {} bytes", bytes.len());
        }
        let line = dir.join("lines.png");
        let series = vec![(
            "lbio".to_string(),
            vec![(1.0, 1e5), (2.0, 2e5), (4.0, 3.9e5)],
        )];
        plot_lines(&line, "test", ("threads", "IOPS"), &series).unwrap();
        assert!(std::fs::read(&line).unwrap().len() > 1000);
        assert!(plot_lines(&line, "test", ("threads", "IOPS"), &[]).is_err());
        let png = std::fs::read(dir.join("cdf.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
