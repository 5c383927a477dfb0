//! The run report: one self-contained HTML file (`RUN_DIR/report.html`) with inline SVG plots
//! (rendered by plotters' SVG backend into strings), inline CSS, no scripts and no external
//! URLs, so it opens anywhere, offline, and can be attached to an issue as is.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::metrics::{is_eval, is_train, keys, num, nums, read_metrics};
use crate::summary::{fmt_secs, percentile, RunSummary};

const PLOT_W: u32 = 560;
const PLOT_H: u32 = 300;

/// Palette (colour-blind-safe Okabe–Ito): rollout, reward, train, sync / series order.
const PALETTE: [RGBColor; 6] = [
    RGBColor(0, 114, 178),   // blue
    RGBColor(230, 159, 0),   // orange
    RGBColor(0, 158, 115),   // green
    RGBColor(204, 121, 167), // purple
    RGBColor(213, 94, 0),    // vermillion
    RGBColor(86, 180, 233),  // sky
];

/// One line of a line chart, optionally with a ± band around it.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    band: Option<Vec<(f64, f64, f64)>>,
    color: RGBColor,
}

fn plot_err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow!("drawing the {what} plot: {e}")
}

/// The (min, max) of values, widened so a flat line or a single point still gets a y range.
fn padded_range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
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

fn x_range(points: impl Iterator<Item = f64>) -> (f64, f64) {
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
fn tick_formatter(span: f64) -> impl Fn(&f64) -> String {
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

fn caption_font() -> TextStyle<'static> {
    ("sans-serif", 17).into_font().color(&RGBColor(34, 34, 34))
}

/// Draws a line chart into an SVG string; `None` when no series has a point.
fn line_chart(title: &str, y_desc: &str, series: &[Series]) -> Result<Option<String>> {
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
        for s in series.iter().filter(|s| !s.points.is_empty()) {
            if let Some(band) = s.band.as_ref().filter(|b| b.len() > 1) {
                let mut outline: Vec<(f64, f64)> =
                    band.iter().map(|(x, _, hi)| (*x, *hi)).collect();
                outline.extend(band.iter().rev().map(|(x, lo, _)| (*x, *lo)));
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
                    s.points.iter().copied(),
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
                    .draw_series(s.points.iter().map(|p| Circle::new(*p, 3, color.filled())))
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
fn time_split_chart(train: &[&Value]) -> Result<Option<String>> {
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
fn staleness_chart(summary: &RunSummary) -> Result<Option<String>> {
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

fn draw_histogram(
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

/// Escapes text for HTML element content and attribute values.
pub fn html_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn series(train: &[&Value], key: &str, name: &str, color: usize) -> Series {
    Series {
        name: name.to_string(),
        points: train
            .iter()
            .filter_map(|r| Some((num(r, keys::STEP)?, num(r, key)?)))
            .collect(),
        band: None,
        color: PALETTE[color],
    }
}

/// A titled plot of the report.
struct Plot {
    title: &'static str,
    svg: Option<String>,
}

fn build_plots(records: &[Value], summary: &RunSummary) -> Result<Vec<Plot>> {
    let train: Vec<&Value> = records.iter().filter(|r| is_train(r)).collect();
    let evals: Vec<&Value> = records.iter().filter(|r| is_eval(r)).collect();
    let mut plots = Vec::new();

    let mut reward = series(&train, keys::REWARD_MEAN, "reward mean", 0);
    let band: Vec<(f64, f64, f64)> = train
        .iter()
        .filter_map(|r| {
            let (x, m, sd) = (
                num(r, keys::STEP)?,
                num(r, keys::REWARD_MEAN)?,
                num(r, keys::REWARD_STD)?,
            );
            Some((x, m - sd, m + sd))
        })
        .collect();
    if !band.is_empty() {
        reward.band = Some(band);
        reward.name = "reward mean (± std band)".into();
    }
    plots.push(Plot {
        title: "Reward",
        svg: line_chart("Reward", "reward", &[reward])?,
    });
    plots.push(Plot {
        title: "Eval accuracy",
        svg: line_chart(
            "Eval accuracy",
            "accuracy",
            &[series(&evals, keys::EVAL_ACCURACY, "eval accuracy", 2)],
        )?,
    });
    plots.push(Plot {
        title: "KL",
        svg: line_chart("KL", "kl", &[series(&train, keys::KL, "kl", 4)])?,
    });
    plots.push(Plot {
        title: "Entropy",
        svg: line_chart(
            "Entropy",
            "nats / token",
            &[series(&train, keys::ENTROPY, "entropy", 3)],
        )?,
    });
    let mut lengths = vec![series(
        &train,
        keys::COMPLETION_MEAN_LENGTH,
        "mean length",
        0,
    )];
    let p95: Vec<(f64, f64)> = train
        .iter()
        .filter_map(|r| {
            Some((
                num(r, keys::STEP)?,
                percentile(&nums(r, keys::COMPLETION_LENGTHS), 95.0)?,
            ))
        })
        .collect();
    if !p95.is_empty() {
        lengths.push(Series {
            name: "p95 length".into(),
            points: p95,
            band: None,
            color: PALETTE[4],
        });
    }
    plots.push(Plot {
        title: "Completion length",
        svg: line_chart("Completion length", "tokens", &lengths)?,
    });
    let losses: Vec<Series> = [
        (keys::LOSS_RLVR, "rlvr"),
        (keys::LOSS_HINT, "hint"),
        (keys::LOSS_REPLAY, "replay"),
    ]
    .iter()
    .enumerate()
    .map(|(i, (key, name))| series(&train, key, name, i))
    .filter(|s| !s.points.is_empty())
    .collect();
    plots.push(Plot {
        title: "Loss channels",
        svg: line_chart("Loss channels", "loss", &losses)?,
    });
    plots.push(Plot {
        title: "Where each step's time went",
        svg: time_split_chart(&train)?,
    });
    plots.push(Plot {
        title: "Staleness",
        svg: staleness_chart(summary)?,
    });
    Ok(plots)
}

const CSS: &str = r#"
:root { --fg:#222; --muted:#666; --line:#e3e3e3; --accent:#0072b2; --bg:#fafafa; }
* { box-sizing: border-box; }
body { margin:0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color:var(--fg); background:var(--bg); }
header { padding: 18px 28px 12px; background:#fff; border-bottom:1px solid var(--line); }
h1 { margin:0; font-size:22px; }
h2 { font-size:16px; margin: 22px 0 10px; color:#333; }
.sub { color:var(--muted); margin:4px 0 0; }
main { padding: 0 28px 28px; max-width: 1220px; }
.cards { display:flex; flex-wrap:wrap; gap:10px; margin-top:16px; }
.card { background:#fff; border:1px solid var(--line); border-radius:8px; padding:10px 14px; min-width:150px; }
.card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.card .v { font-size:20px; font-weight:600; }
.grid { display:grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap:14px; }
figure { margin:0; background:#fff; border:1px solid var(--line); border-radius:8px; padding:6px; }
figure svg { width:100%; height:auto; display:block; }
table { border-collapse:collapse; background:#fff; border:1px solid var(--line); }
th, td { padding:5px 12px; border-bottom:1px solid var(--line); text-align:left; vertical-align:top; }
th { background:#f3f3f3; font-weight:600; }
td.num { text-align:right; font-variant-numeric: tabular-nums; }
tr.binding td { background:#fff4e0; font-weight:600; }
.tables { display:flex; flex-wrap:wrap; gap:16px; align-items:flex-start; }
pre { background:#fff; border:1px solid var(--line); border-radius:8px; padding:12px; overflow:auto;
      font: 12.5px/1.45 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
.note { color:var(--muted); }
footer { color:var(--muted); padding: 0 28px 24px; font-size:12px; }
"#;

fn render_html(
    run_dir: &Path,
    records: &[Value],
    recipe: Option<&str>,
    summary: &RunSummary,
) -> Result<String> {
    let plots = build_plots(records, summary)?;
    let name = run_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| run_dir.display().to_string());
    let mut h = String::new();
    let w = &mut h;
    // `write!` into a String cannot fail.
    let _ = write!(
        w,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>composer-rl report: {}</title><style>{CSS}</style></head><body>\n",
        html_escape(&name)
    );
    let _ = write!(
        w,
        "<header><h1>composer-rl run report: {}</h1><p class=\"sub\">{} · {} training steps · {} records</p></header>\n<main>\n",
        html_escape(&name),
        html_escape(&run_dir.display().to_string()),
        summary.steps,
        records.len()
    );

    // Headline cards.
    let mut cards: Vec<(&str, String)> = Vec::new();
    if let Some(r) = summary.reward_last {
        cards.push(("reward (last)", format!("{r:.3}")));
    }
    if let Some(a) = summary.eval_last {
        cards.push(("eval accuracy (last)", format!("{a:.3}")));
    }
    if let (Some(b), Some(s)) = (&summary.binding_wall, summary.binding_share) {
        cards.push(("binding wall", format!("{b} {:.0}%", s * 100.0)));
    }
    if let Some(g) = summary.goodput_tokens_per_s {
        cards.push(("goodput", format!("{} tok/s", crate::summary::fmt_num(g))));
    }
    if let Some(t) = summary.straggler_tax {
        cards.push(("straggler tax p95/p50", format!("×{t:.2}")));
    }
    cards.push(("mean step", fmt_secs(summary.mean_step_s)));
    let _ = w.write_str("<div class=\"cards\">");
    for (k, v) in &cards {
        let _ = write!(
            w,
            "<div class=\"card\"><div class=\"k\">{}</div><div class=\"v\">{}</div></div>",
            html_escape(k),
            html_escape(v)
        );
    }
    let _ = w.write_str("</div>\n");

    // Summary tables.
    let _ = w.write_str("<h2>Summary</h2>\n<div class=\"tables\">");
    if !summary.walls.is_empty() {
        let _ = w.write_str(
            "<table class=\"walls\"><tr><th>wall</th><th>total</th><th>mean / step</th><th>share of step</th></tr>",
        );
        for wall in &summary.walls {
            let binding = summary.binding_wall.as_deref() == Some(wall.name.as_str());
            let _ = write!(
                w,
                "<tr{}><td>{}{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{:.1}%</td></tr>",
                if binding { " class=\"binding\"" } else { "" },
                html_escape(&wall.name),
                if binding { " (binding)" } else { "" },
                fmt_secs(wall.total_s),
                fmt_secs(wall.mean_s),
                wall.share * 100.0
            );
        }
        let _ = w.write_str("</table>");
    }
    let _ = w.write_str("<table class=\"summary\">");
    for (label, value) in summary.rows() {
        let _ = write!(
            w,
            "<tr><th>{}</th><td>{}</td></tr>",
            html_escape(&label),
            html_escape(&value)
        );
    }
    let _ = w.write_str("</table></div>\n");

    // Plots.
    let _ = w.write_str("<h2>Plots</h2>\n<div class=\"grid\">\n");
    let mut missing = Vec::new();
    for plot in &plots {
        match &plot.svg {
            Some(svg) => {
                let _ = writeln!(
                    w,
                    "<figure aria-label=\"{}\">{svg}</figure>",
                    html_escape(plot.title)
                );
            }
            None => missing.push(plot.title),
        }
    }
    let _ = w.write_str("</div>\n");
    if !missing.is_empty() {
        let _ = writeln!(
            w,
            "<p class=\"note\">Not in the metrics (no plot): {}.</p>",
            html_escape(&missing.join(", "))
        );
    }

    let _ = w.write_str("<h2>Recipe</h2>\n");
    match recipe {
        Some(text) => {
            let _ = writeln!(w, "<pre class=\"recipe\">{}</pre>", html_escape(text));
        }
        None => {
            let _ = w.write_str("<p class=\"note\">No recipe.toml in the run directory.</p>\n");
        }
    }
    let _ = w.write_str(
        "</main><footer>Generated by <code>composer-rl report</code> from metrics.jsonl. \
         Walls: rollout τ_R, reward τ_V, train τ_T, sync τ_S; in async mode they overlap.</footer>\n</body></html>\n",
    );
    Ok(h)
}

/// Reads `RUN_DIR/metrics.jsonl` (required, with at least one record) and `RUN_DIR/recipe.toml`
/// (optional) and writes `RUN_DIR/report.html`; returns its path.
pub fn write_report(run_dir: &Path) -> Result<PathBuf> {
    let metrics_path = run_dir.join("metrics.jsonl");
    if !metrics_path.is_file() {
        bail!(
            "no metrics file {} (is {} a composer-rl run directory?)",
            metrics_path.display(),
            run_dir.display()
        );
    }
    let records = read_metrics(&metrics_path)?;
    if records.is_empty() {
        bail!(
            "metrics file {} has no records: nothing to report",
            metrics_path.display()
        );
    }
    let recipe_path = run_dir.join("recipe.toml");
    let recipe = if recipe_path.is_file() {
        Some(
            fs::read_to_string(&recipe_path)
                .with_context(|| format!("reading {}", recipe_path.display()))?,
        )
    } else {
        None
    };
    let summary = RunSummary::from_metrics(&records);
    let html = render_html(run_dir, &records, recipe.as_deref(), &summary)?;
    let out = run_dir.join("report.html");
    composer_fsutil::write_atomic(&out, html.as_bytes())
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(out)
}

/// `composer-rl report RUN_DIR`: writes the report and returns the line to print
/// (the report's path followed by the terminal summary).
pub fn report_cli(run_dir: &Path) -> Result<String> {
    let out = write_report(run_dir)?;
    let records = read_metrics(&run_dir.join("metrics.jsonl"))?;
    let summary = RunSummary::from_metrics(&records);
    Ok(format!("wrote {}\n\n{summary}", out.display()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::metrics::MetricsWriter;
    use serde_json::json;

    /// A 20-step synthetic run with every key of the contract, plus evals every 5 steps.
    /// `trained_tokens` is the trainer's running total: 4000 tokens per step.
    pub(crate) fn synthetic_run(dir: &Path) {
        let mut w = MetricsWriter::create(&dir.join("metrics.jsonl")).unwrap();
        for step in 1..=20u64 {
            let s = step as f64;
            w.write(&json!({
                "kind": "train", "step": step, "policy_version": step,
                "reward/mean": 0.2 + 0.03 * s, "reward/std": 0.1,
                "completions/mean_length": 300.0 + 5.0 * s,
                "completions/clipped_ratio": 0.05,
                "completions/lengths": [100 + step, 300, 500, 900 + 10 * step],
                "loss/rlvr": 0.5 / s, "loss/hint": 0.1, "loss/replay": 0.05,
                "kl": 0.001 * s, "entropy": 1.5 - 0.02 * s,
                "time/rollout_s": 6.0, "time/reward_s": 1.5, "time/train_s": 2.0,
                "time/sync_s": 0.5, "time/step_s": 10.0, "tokens_per_s": 1500.0,
                "trained_tokens": 4000 * step, "env/latency_s": [0.2, 0.4],
                "staleness/values": [0, 1, (step % 3)], "staleness/max": step % 3,
                "idle/trainer_s": 0.5,
            }))
            .unwrap();
            if step % 5 == 0 {
                w.write(&json!({"kind": "eval", "step": step, "eval/accuracy": 0.1 * s / 5.0}))
                    .unwrap();
            }
        }
        fs::write(
            dir.join("recipe.toml"),
            "[model]\nname = \"qwen<3>&co\"\n[loss]\nalpha = 0.5 # \"hint\"\n",
        )
        .unwrap();
    }

    #[test]
    fn report_is_self_contained_with_every_plot() {
        let dir = tempfile::tempdir().unwrap();
        synthetic_run(dir.path());
        let out = write_report(dir.path()).unwrap();
        assert_eq!(out, dir.path().join("report.html"));
        let html = fs::read_to_string(&out).unwrap();
        // 8 plots: reward, eval, kl, entropy, length, losses, time split, staleness.
        assert_eq!(html.matches("<svg").count(), 8, "one <svg> per plot");
        assert!(!html.contains("<script"));
        assert!(!html.contains("src=\"http") && !html.contains("href=\"http"));
        assert!(!html.contains("Not in the metrics"));
        // Recipe is escaped inside <pre>.
        assert!(
            html.contains("name = &quot;qwen&lt;3&gt;&amp;co&quot;"),
            "{html}"
        );
        assert!(!html.contains("qwen<3>"));
        // Summary numbers: rollout 6 s of a 10 s step binds at 60%; goodput 4000/10 = 400.
        assert!(html.contains("rollout (binding)"));
        assert!(html.contains("60.0%"));
        assert!(html.contains("400 trained tok/s"));
        assert!(html.contains("Where each step"));
        assert!(html.contains("policy-version lag"));
        assert!(!dir.path().join(".report.html.tmp").exists());
        let text = report_cli(dir.path()).unwrap();
        assert!(
            text.contains("report.html") && text.contains("binding"),
            "{text}"
        );
    }

    #[test]
    fn report_of_a_sparse_run_lists_missing_plots() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = MetricsWriter::create(&dir.path().join("metrics.jsonl")).unwrap();
        w.write(&json!({"kind":"train","step":1,"reward/mean":0.5}))
            .unwrap();
        let html = fs::read_to_string(write_report(dir.path()).unwrap()).unwrap();
        assert_eq!(html.matches("<svg").count(), 1);
        assert!(html.contains("Not in the metrics (no plot): Eval accuracy, KL"));
        assert!(html.contains("No recipe.toml"));
    }

    #[test]
    fn missing_or_empty_metrics_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", write_report(dir.path()).unwrap_err());
        assert!(err.contains("metrics.jsonl"), "{err}");
        fs::write(dir.path().join("metrics.jsonl"), "\n").unwrap();
        let err = format!("{:#}", write_report(dir.path()).unwrap_err());
        assert!(
            err.contains("metrics.jsonl") && err.contains("no records"),
            "{err}"
        );
        fs::write(dir.path().join("metrics.jsonl"), "{}\n{oops\n{}\n").unwrap();
        let err = format!("{:#}", write_report(dir.path()).unwrap_err());
        assert!(err.contains("metrics.jsonl line 2"), "{err}");
    }
}
