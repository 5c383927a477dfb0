//! The run report: one self-contained HTML file (`RUN_DIR/report.html`) with inline SVG plots
//! (rendered by plotters' SVG backend into strings), inline CSS, no scripts and no external
//! URLs, so it opens anywhere, offline, and can be attached to an issue as is.
//!
//! The charts are drawn in `charts`; this module picks the plots and renders the page.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::metrics::{is_eval, is_train, keys, num, nums, read_metrics_checked};
use crate::summary::{fmt_secs, percentile, RunSummary};

mod charts;
use charts::{line_chart, staleness_chart, time_split_chart, Series, PALETTE};

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

/// Reads `RUN_DIR/metrics.jsonl` (required, with at least one record, values checked by
/// [`read_metrics_checked`]) and `RUN_DIR/recipe.toml` (optional) and writes
/// `RUN_DIR/report.html`; returns its path.
pub fn write_report(run_dir: &Path) -> Result<PathBuf> {
    let metrics_path = run_dir.join("metrics.jsonl");
    if !metrics_path.is_file() {
        bail!(
            "no metrics file {} (is {} a composer-rl run directory?)",
            metrics_path.display(),
            run_dir.display()
        );
    }
    let records = read_metrics_checked(&metrics_path)?;
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
    let records = read_metrics_checked(&run_dir.join("metrics.jsonl"))?;
    let summary = RunSummary::from_metrics(&records);
    Ok(format!("wrote {}\n\n{summary}", out.display()))
}

#[cfg(test)]
pub(crate) mod tests;
