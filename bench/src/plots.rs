//! The cost curves, drawn as SVG files (plotters' SVG backend: no fonts or system libraries
//! needed) next to the report they illustrate, and linked from it.
//!
//! - `memory-vs-queue-bytes.svg` (row 8): sidecar and controller resident memory against the
//!   MiB of payload in their queue.
//! - `claims-vs-claimers.svg` (row 2): claims per second and the share of claim writes
//!   answered 409, against the number of concurrent claimers.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use plotters::prelude::*;

/// One line of a chart: its name and its (x, y) points, in drawing order.
pub struct Line {
    /// Shown in the legend.
    pub name: String,
    /// The points.
    pub points: Vec<(f64, f64)>,
}

/// A chart: title, axis descriptions and lines (at most 4; one color each).
pub struct Chart {
    /// File name inside the plots directory, ending in `.svg`.
    pub file: &'static str,
    /// Shown above the chart.
    pub title: String,
    /// Horizontal axis, with its unit.
    pub x: &'static str,
    /// Vertical axis, with its unit.
    pub y: &'static str,
    /// The lines.
    pub lines: Vec<Line>,
}

const COLORS: [RGBColor; 4] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];

/// Draws `chart` into `dir` (created if missing) as the file `file`. Returns the file
/// written.
///
/// # Errors
/// When the directory cannot be created or the file written.
pub fn draw(dir: &Path, file: &str, chart: &Chart) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let path = dir.join(file);
    let all = chart.lines.iter().flat_map(|l| l.points.iter());
    let (x_max, y_max) = all.fold((0f64, 0f64), |(x, y), p| (x.max(p.0), y.max(p.1)));
    let root = SVGBackend::new(&path, (720, 420)).into_drawing_area();
    let fail = |e: &dyn std::fmt::Display| anyhow::anyhow!("draw {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut c = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..(x_max * 1.05).max(1.0), 0f64..(y_max * 1.15).max(1.0))
        .map_err(|e| fail(&e))?;
    c.configure_mesh()
        .x_desc(chart.x)
        .y_desc(chart.y)
        .draw()
        .map_err(|e| fail(&e))?;
    for (line, color) in chart.lines.iter().zip(COLORS) {
        c.draw_series(LineSeries::new(line.points.clone(), color.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(&line.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        c.draw_series(
            line.points
                .iter()
                .map(|&p| Circle::new(p, 3, color.filled())),
        )
        .map_err(|e| fail(&e))?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    drop(c);
    drop(root);
    Ok(path)
}
