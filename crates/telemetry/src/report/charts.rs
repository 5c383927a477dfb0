//! The report's SVG charts (plotters' SVG backend into strings): line charts, the step-time
//! split, the staleness histogram.

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::metrics::{keys, num};
use crate::summary::RunSummary;

pub(super) const PLOT_W: u32 = 560;
pub(super) const PLOT_H: u32 = 300;

/// Palette (colour-blind-safe Okabe–Ito): rollout, reward, train, sync / series order.
pub(super) const PALETTE: [RGBColor; 6] = [
    RGBColor(0, 114, 178),   // blue
    RGBColor(230, 159, 0),   // orange
    RGBColor(0, 158, 115),   // green
    RGBColor(204, 121, 167), // purple
    RGBColor(213, 94, 0),    // vermillion
    RGBColor(86, 180, 233),  // sky
];

/// One line of a line chart, optionally with a ± band around it.
pub(super) struct Series {
    pub(super) name: String,
    pub(super) points: Vec<(f64, f64)>,
    pub(super) band: Option<Vec<(f64, f64, f64)>>,
    pub(super) color: RGBColor,
}

pub(super) fn plot_err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow!("drawing the {what} plot: {e}")
}

/// Largest magnitude an axis reaches: values beyond it (a diverging grad norm of 1e308) are
/// drawn at the edge, so the span, its padding and the legend headroom stay finite (an
/// infinite axis made plotters loop forever).
const MAX_AXIS: f64 = 1e300;

/// The (min, max) of values, widened so a flat line or a single point still gets a y range.
pub(super) fn padded_range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        let v = v.clamp(-MAX_AXIS, MAX_AXIS);
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if lo > hi {
        return None;
    }
    let span = hi - lo;
    let pad = if span > 0.0 {
        span * 0.08
    } else {
        (hi.abs() * 0.1).max(0.5)
    };
    Some((lo - pad, hi + pad))
}

pub(super) fn x_range(points: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for x in points {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if lo > hi {
        (0.0, 1.0)
    } else if lo == hi {
        (lo - 1.0, hi + 1.0)
    } else {
        (lo, hi)
    }
}

/// Tick labels with as many decimals as the axis span needs (span 1 → 2 decimals, 0.02 → 4),
/// so every label of one axis has the same format.
pub(super) fn tick_formatter(span: f64) -> impl Fn(&f64) -> String {
    let decimals = if span > 0.0 && span.is_finite() {
        (2.0 - span.log10().floor()).clamp(0.0, 8.0) as usize
    } else {
        2
    };
    move |v: &f64| {
        if v.abs() >= 1e4 {
            crate::summary::fmt_num(*v)
        } else {
            format!("{v:.decimals$}")
        }
    }
}

pub(super) fn caption_font() -> TextStyle<'static> {
    ("sans-serif", 17).into_font().color(&RGBColor(34, 34, 34))
}

/// Draws a line chart into an SVG string; `None` when no series has a point.
pub(super) fn line_chart(title: &str, y_desc: &str, series: &[Series]) -> Result<Option<String>> {
    if series.iter().all(|s| s.points.is_empty()) {
        return Ok(None);
    }
    let all_x = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x0, x1) = x_range(all_x);
    let ys = series.iter().flat_map(|s| {
        s.points.iter().map(|p| p.1).chain(
            s.band
                .iter()
                .flat_map(|b| b.iter().flat_map(|(_, lo, hi)| [*lo, *hi])),
        )
    });
    let Some((y0, mut y1)) = padded_range(ys) else {
        return Ok(None);
    };
    let has_legend = series.len() > 1 || series.iter().any(|s| s.band.is_some());
    if has_legend {
        // Headroom so the legend (upper left) sits above the data, not on it.
        y1 += (y1 - y0) * 0.3;
    }
    let y_fmt = tick_formatter(y1 - y0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (PLOT_W, PLOT_H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err(title))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, caption_font())
            .margin(10)
            .x_label_area_size(34)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(plot_err(title))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .x_labels(8)
            .y_labels(6)
            .y_label_formatter(&y_fmt)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .light_line_style(RGBColor(247, 247, 247))
            .bold_line_style(RGBColor(225, 225, 225))
            .draw()
            .map_err(plot_err(title))?;
        // Points go through the same clamp as the range: one far outside it would overflow
        // plotters' pixel arithmetic.
        let on_axis = |(x, y): (f64, f64)| (x, y.clamp(-MAX_AXIS, MAX_AXIS));
        for s in series.iter().filter(|s| !s.points.is_empty()) {
            if let Some(band) = s.band.as_ref().filter(|b| b.len() > 1) {
                let mut outline: Vec<(f64, f64)> =
                    band.iter().map(|(x, _, hi)| on_axis((*x, *hi))).collect();
                outline.extend(band.iter().rev().map(|(x, lo, _)| on_axis((*x, *lo))));
                chart
                    .draw_series(std::iter::once(Polygon::new(
                        outline,
                        s.color.mix(0.18).filled(),
                    )))
                    .map_err(plot_err(title))?;
            }
            let color = s.color;
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied().map(on_axis),
                    color.stroke_width(2),
                ))
                .map_err(plot_err(title))?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            // Markers where points are sparse (evals, short runs), so single points show.
            if s.points.len() <= 60 {
                chart
                    .draw_series(
                        s.points
                            .iter()
                            .map(|p| Circle::new(on_axis(*p), 3, color.filled())),
                    )
                    .map_err(plot_err(title))?;
            }
        }
        if has_legend {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(200, 200, 200))
                .label_font(("sans-serif", 12))
                .draw()
                .map_err(plot_err(title))?;
        }
        root.present().map_err(plot_err(title))?;
    }
    Ok(Some(svg))
}

/// Stacked area of the per-step walls (rollout, reward, train, sync).
pub(super) fn time_split_chart(train: &[&Value]) -> Result<Option<String>> {
    let title = "Where each step's time went";
    let present: Vec<(usize, &str, &str)> = crate::summary::WALLS
        .iter()
        .enumerate()
        .filter(|(_, (_, key))| train.iter().any(|r| num(r, key).is_some()))
        .map(|(i, (name, key))| (i, *name, *key))
        .collect();
    let rows: Vec<(f64, Vec<f64>)> = train
        .iter()
        .filter_map(|r| {
            let step = num(r, keys::STEP)?;
            let walls: Vec<f64> = present
                .iter()
                .map(|(_, _, key)| num(r, key).unwrap_or(0.0).max(0.0))
                .collect();
            Some((step, walls))
        })
        .collect();
    if present.is_empty() || rows.is_empty() {
        return Ok(None);
    }
    let (x0, x1) = x_range(rows.iter().map(|r| r.0));
    let y_max = rows
        .iter()
        .map(|(_, w)| w.iter().sum::<f64>())
        .fold(0.0, f64::max);
    // Headroom for the legend (upper right) above the stack.
    let y1 = if y_max > 0.0 { y_max * 1.4 } else { 1.0 };
    let y_fmt = tick_formatter(y1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (PLOT_W, PLOT_H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err(title))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, caption_font())
            .margin(10)
            .x_label_area_size(34)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, 0.0..y1)
            .map_err(plot_err(title))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("seconds")
            .x_labels(8)
            .y_labels(6)
            .y_label_formatter(&y_fmt)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .light_line_style(RGBColor(247, 247, 247))
            .bold_line_style(RGBColor(225, 225, 225))
            .draw()
            .map_err(plot_err(title))?;
        // A single step gets a bar of width 1 so it is visible.
        let rows: Vec<(f64, Vec<f64>)> = if rows.len() == 1 {
            let (x, w) = rows[0].clone();
            vec![(x - 0.4, w.clone()), (x + 0.4, w)]
        } else {
            rows
        };
        let mut below: Vec<f64> = vec![0.0; rows.len()];
        for (layer, (palette_idx, name, _)) in present.iter().enumerate() {
            let above: Vec<f64> = rows
                .iter()
                .zip(&below)
                .map(|((_, w), b)| b + w[layer])
                .collect();
            let mut outline: Vec<(f64, f64)> = rows
                .iter()
                .zip(&above)
                .map(|((x, _), y)| (*x, *y))
                .collect();
            outline.extend(rows.iter().zip(&below).rev().map(|((x, _), y)| (*x, *y)));
            let color = PALETTE[*palette_idx];
            chart
                .draw_series(std::iter::once(Polygon::new(
                    outline,
                    color.mix(0.75).filled(),
                )))
                .map_err(plot_err(title))?
                .label(*name)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
                });
            below = above;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(plot_err(title))?;
        root.present().map_err(plot_err(title))?;
    }
    Ok(Some(svg))
}

/// Bar chart of trajectory counts per policy-version lag.
pub(super) fn staleness_chart(summary: &RunSummary) -> Result<Option<String>> {
    let title = "Staleness of consumed trajectories";
    if summary.staleness_histogram.is_empty() {
        return Ok(None);
    }
    let max_lag = summary
        .staleness_histogram
        .keys()
        .copied()
        .max()
        .unwrap_or(0);
    let max_count = summary
        .staleness_histogram
        .values()
        .copied()
        .max()
        .unwrap_or(1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (PLOT_W, PLOT_H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err(title))?;
        draw_histogram(&root, title, summary, max_lag, max_count)?;
        root.present().map_err(plot_err(title))?;
    }
    Ok(Some(svg))
}

pub(super) fn draw_histogram(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    summary: &RunSummary,
    max_lag: u64,
    max_count: u64,
) -> Result<()> {
    let mut chart = ChartBuilder::on(root)
        .caption(title, caption_font())
        .margin(10)
        .x_label_area_size(34)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (0u64..max_lag).into_segmented(),
            0u64..(max_count + max_count / 8 + 1),
        )
        .map_err(plot_err(title))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("policy-version lag")
        .y_desc("trajectories")
        .light_line_style(RGBColor(247, 247, 247))
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(plot_err(title))?;
    chart
        .draw_series(
            Histogram::vertical(&chart)
                .style(PALETTE[0].mix(0.8).filled())
                .margin(6)
                .data(summary.staleness_histogram.iter().map(|(l, n)| (*l, *n))),
        )
        .map_err(plot_err(title))?;
    Ok(())
}
