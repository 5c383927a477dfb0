#!/usr/bin/env bash
# Manual check (not run by CI) that `composer-rl report` output renders in a real browser.
#
# 1. Writes a synthetic 120-step run (every metric key of the contract, evals, async
#    staleness) and its report.html with the composer-telemetry example.
# 2. Screenshots the report with headless Chromium (Debian: `apt-get install -y chromium`).
# 3. Look at the PNG: 8 plots in a 2-column grid (reward ± std band, eval accuracy, KL,
#    entropy, completion length mean/p95, loss channels, stacked time split, staleness
#    histogram), headline cards, walls + summary tables, the escaped recipe at the bottom.
#    Legends must not hide the data, tick labels must be readable, no broken layout.
#
# Usage: tools/render_report_check.sh [RUN_DIR] [PNG]
#   With a RUN_DIR that already holds metrics.jsonl, that run's report is rendered instead.
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir="${1:-/tmp/synthetic-run}"
png="${2:-/tmp/report.png}"

if [[ -f "$run_dir/metrics.jsonl" && -n "${1:-}" ]]; then
  cargo run -q -p composer-rl -- report "$run_dir"
else
  cargo run -q -p composer-telemetry --example synthetic_report -- "$run_dir"
fi

browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [[ -z "$browser" ]]; then
  echo "no chromium found: apt-get update && apt-get install -y chromium" >&2
  exit 1
fi
# No network, no profile, no GPU: the report must be self-contained.
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$(mktemp -d)" --screenshot="$png" --window-size=1200,2400 \
  "file://$(realpath "$run_dir")/report.html" 2>/dev/null
echo "screenshot: $png (open it and check the list above)"
