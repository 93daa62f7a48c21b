//! The report as one self-contained HTML page: inline CSS, the duplicate-rate chart
//! as inline SVG (markers as labelled ticks on a lane under the plot), tables for
//! the rest. Nothing is fetched when it opens.

use std::fmt::Write;

use super::{ConsumerReport, Report};
use crate::alerts::{Cause, DEPLOY_DAY_RATIO, NORMAL_DAY_RATIO};
use crate::deploys::WindowEnd;
use idemwatch_base::clock::{clock, date_time};

/// Text as HTML (also inside attributes).
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn pct(r: Option<f64>) -> String {
    r.map_or("—".into(), |r| format!("{:.3}%", r * 100.0))
}

fn rate(r: Option<f64>) -> String {
    r.map_or("—".into(), |r| format!("{r:.2}"))
}

const COLORS: [&str; 6] = [
    "#0e7c86", "#c77d00", "#8e44ad", "#2e7d32", "#1565c0", "#c62828",
];
const MARKER_COLORS: [(&str, &str); 5] = [
    ("deploy", "#b8860b"),
    ("restart", "#d32f2f"),
    ("drill", "#7b1fa2"),
    ("manual", "#455a64"),
    ("incident", "#b71c1c"),
];

fn marker_color(kind: &str) -> &'static str {
    MARKER_COLORS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or("#555", |(_, c)| c)
}

/// Where the chart draws: the plot's box and scales, the marker lane under it.
///
/// ```text
///  y labels ┌──────────────── plot ─────────────────┐
///   0.50%   │  ╱╲  series (a gap breaks a line)  ▲   │  ▲ a peak clipped at y_max
///   ......  │- - - - - - deploy day 0.4% - - - - - -│
///     0%    └───────────────────────────────────────┘
///             10:00      10:15      10:30  time labels
///  markers    [D] deploy   [R] restart       the lane, two rows
/// ```
struct Plot {
    left: f64,
    top: f64,
    plot_w: f64,
    plot_h: f64,
    lane: f64,
    from: f64,
    span: f64,
    /// The y axis's top, in percent: 1.5 × the 95th percentile, at least 1.25 × the
    /// deploy-day ratio (both baselines stay in view), at most the highest value.
    y_max: f64,
}

impl Plot {
    const W: f64 = 960.0;
    const H: f64 = 330.0;

    fn of(report: &Report) -> Self {
        let mut values: Vec<f64> = report
            .consumers
            .iter()
            .flat_map(|c| c.points.iter().filter_map(|p| p.duplicate_ratio))
            .map(|r| r * 100.0)
            .collect();
        values.sort_by(|a, b| a.total_cmp(b));
        let floor = DEPLOY_DAY_RATIO * 100.0 * 1.25;
        let y_max = values
            .get(((values.len().max(1) - 1) as f64 * 0.95).round() as usize)
            .map_or(floor, |p95| (p95 * 1.5).max(floor))
            .min(values.last().copied().unwrap_or(floor).max(floor));
        let from = report.from.timestamp() as f64;
        let left = 70.0;
        Plot {
            left,
            top: 20.0,
            plot_w: Self::W - left - 20.0,
            plot_h: 220.0,
            lane: 40.0,
            from,
            span: (report.to.timestamp() as f64 - from).max(1.0),
            y_max,
        }
    }

    fn x(&self, t: f64) -> f64 {
        self.left + (t - self.from) / self.span * self.plot_w
    }

    fn y(&self, pct: f64) -> f64 {
        self.top + self.plot_h - pct.min(self.y_max) / self.y_max * self.plot_h
    }
}

/// The duplicate-rate chart: one polyline per consumer (a gap breaks it), the
/// normal-day and deploy-day baselines, clipped peaks marked ▲, markers on a lane.
pub fn chart(report: &Report) -> String {
    let p = Plot::of(report);
    let (w, h) = (Plot::W, Plot::H);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" id="duplicate-rate" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="duplicate rate over the window">"#
    );
    axes(&mut svg, &p);
    for (i, c) in report.consumers.iter().enumerate() {
        series(&mut svg, &p, c, COLORS[i % COLORS.len()]);
    }
    time_labels(&mut svg, &p, report);
    marker_lane(&mut svg, &p, report);
    svg.push_str("</svg>");
    svg
}

/// The plot's box, the y labels and the two baselines.
fn axes(svg: &mut String, p: &Plot) {
    let (left, top, plot_w, plot_h) = (p.left, p.top, p.plot_w, p.plot_h);
    let _ = write!(
        svg,
        r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>"##
    );
    for (v, label) in [
        (0.0, "0%".to_string()),
        (p.y_max / 2.0, format!("{:.2}%", p.y_max / 2.0)),
        (p.y_max, format!("{:.2}%", p.y_max)),
    ] {
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" font-size="11" text-anchor="end" fill="#555">{label}</text>"##,
            left - 6.0,
            p.y(v) + 4.0
        );
    }
    for (ratio, name) in [
        (NORMAL_DAY_RATIO, "normal day 0.01%"),
        (DEPLOY_DAY_RATIO, "deploy day 0.4%"),
    ] {
        let yy = p.y(ratio * 100.0);
        let _ = write!(
            svg,
            r##"<line x1="{left}" x2="{}" y1="{yy}" y2="{yy}" stroke="#999" stroke-dasharray="4 4"/><text class="baseline" x="{}" y="{}" font-size="10" text-anchor="end" fill="#777">{name}</text>"##,
            left + plot_w,
            left + plot_w - 4.0,
            yy - 3.0
        );
    }
}

/// One consumer's line (a polyline per run between gaps) and its clipped peaks.
fn series(svg: &mut String, p: &Plot, c: &ConsumerReport, color: &str) {
    for run in runs(c) {
        let pts: Vec<String> = run
            .iter()
            .map(|(t, r)| format!("{:.1},{:.1}", p.x(*t), p.y(r * 100.0)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline class="series" data-consumer="{}" fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            esc(&c.consumer),
            pts.join(" ")
        );
        for (t, r) in run.iter().filter(|(_, r)| r * 100.0 > p.y_max) {
            let _ = write!(
                svg,
                r##"<text class="clipped" x="{:.1}" y="{}" font-size="10" text-anchor="middle" fill="#c62828">▲<title>{:.2}%</title></text>"##,
                p.x(*t),
                p.top + 9.0,
                r * 100.0
            );
        }
    }
}

/// Five time labels under the plot.
fn time_labels(svg: &mut String, p: &Plot, report: &Report) {
    for k in 0..5 {
        let f = f64::from(k) / 4.0;
        let t = report.from + chrono::Duration::seconds((f * p.span) as i64);
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{}" font-size="11" text-anchor="middle" fill="#555">{}</text>"##,
            p.left + f * p.plot_w,
            p.top + p.plot_h + 14.0,
            clock(t)
        );
    }
}

/// The marker lane: per marker a dashed line across the plot, a tick with the kind's
/// letter and its label, on two alternating rows so neighbours do not overlap.
fn marker_lane(svg: &mut String, p: &Plot, report: &Report) {
    let (top, plot_h) = (p.top, p.plot_h);
    let lane_y = top + plot_h + 22.0;
    let _ = write!(
        svg,
        r##"<text x="{}" y="{}" font-size="10" text-anchor="end" fill="#555">markers</text>"##,
        p.left - 6.0,
        lane_y + 12.0
    );
    for (i, m) in report.markers.iter().enumerate() {
        let mx = p.x(m.at.timestamp() as f64);
        let color = marker_color(&m.kind);
        let row = (i % 2) as f64 * (p.lane / 2.0);
        let letter = crate::markers::glyph(&m.kind);
        let _ = write!(
            svg,
            r##"<line x1="{mx:.1}" x2="{mx:.1}" y1="{top}" y2="{}" stroke="{color}" stroke-width="0.6" stroke-dasharray="2 3" opacity="0.6"/><g class="marker" data-kind="{kind}"><rect x="{:.1}" y="{:.1}" width="12" height="13" fill="{color}"/><text x="{:.1}" y="{:.1}" font-size="10" fill="#fff" text-anchor="middle">{letter}</text><text class="marker-label" x="{:.1}" y="{:.1}" font-size="11" fill="{color}">{label}</text></g>"##,
            top + plot_h,
            mx - 6.0,
            lane_y + row,
            mx,
            lane_y + row + 10.0,
            mx + 8.0,
            lane_y + row + 10.0,
            kind = esc(&m.kind),
            label = esc(&m.label),
        );
    }
}

/// A consumer's points as runs of (unix seconds, ratio): a gap breaks the line.
fn runs(c: &ConsumerReport) -> Vec<Vec<(f64, f64)>> {
    let mut out = Vec::new();
    let mut run = Vec::new();
    for p in &c.points {
        match p.duplicate_ratio {
            Some(r) => run.push((p.t as f64, r)),
            None if !run.is_empty() => out.push(std::mem::take(&mut run)),
            None => {}
        }
    }
    if !run.is_empty() {
        out.push(run);
    }
    out
}

fn table(out: &mut String, title: &str, header: &[&str], rows: Vec<Vec<String>>) {
    let _ = write!(out, "<h2>{}</h2>", esc(title));
    if rows.is_empty() {
        out.push_str("<p class=\"none\">none in this window</p>");
        return;
    }
    out.push_str("<table><thead><tr>");
    for h in header {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            let _ = write!(out, "<td>{}</td>", esc(&cell));
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
}

/// The whole page, top to bottom: title, the chart and its legend, then one table
/// per part of the report.
pub fn page(r: &Report) -> String {
    let mut out = String::new();
    head(&mut out, r);
    duplicate_rate(&mut out, r);
    rates(&mut out, r);
    markers(&mut out, r);
    deploys(&mut out, r);
    alerts(&mut out, r);
    dead_letters(&mut out, r);
    claims(&mut out, r);
    windows(&mut out, r);
    drills(&mut out, r);
    out.push_str("</body></html>\n");
    out
}

/// The document's head (title, inline CSS), the heading, source and notes.
fn head(out: &mut String, r: &Report) {
    let title = format!(
        "idemwatch report {} – {} UTC",
        date_time(r.from),
        clock(r.to)
    );
    let _ = write!(
        out,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>\
         body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse;margin-bottom:1em}}\
         td,th{{border:1px solid #ddd;padding:3px 8px;font-size:13px;text-align:left}}th{{background:#f3f3f3}}\
         .none{{color:#777}}.crit{{color:#c62828;font-weight:bold}}.legend span{{margin-right:1.5em}}</style></head><body>",
        esc(&title)
    );
    let _ = write!(
        out,
        "<h1>{}</h1><p>source: {} · generated {} UTC</p>",
        esc(&title),
        esc(&r.source),
        date_time(r.generated_at)
    );
    for n in &r.notes {
        let _ = write!(out, "<p class=\"none\">{}</p>", esc(n));
    }
}

/// The chart and its legend (a consumer's colour as in the chart).
fn duplicate_rate(out: &mut String, r: &Report) {
    out.push_str("<h2>Duplicate rate</h2>");
    out.push_str(&chart(r));
    out.push_str("<p class=\"legend\">");
    for (i, c) in r.consumers.iter().enumerate() {
        let _ = write!(
            out,
            "<span style=\"color:{}\">━ {}/{}</span>",
            COLORS[i % COLORS.len()],
            esc(&c.target),
            esc(&c.consumer)
        );
    }
    out.push_str("</p>");
}

fn rates(out: &mut String, r: &Report) {
    table(
        out,
        "Per-consumer rates (means over the window)",
        &[
            "target",
            "consumer",
            "msgs/s",
            "dup/s",
            "dup %",
            "peak dup %",
            "redeliv/s",
            "dead/s",
        ],
        r.consumers
            .iter()
            .map(|c| {
                vec![
                    c.target.clone(),
                    c.consumer.clone(),
                    rate(c.processed_per_second),
                    rate(c.duplicate_dropped_per_second),
                    pct(c.duplicate_ratio),
                    pct(c.peak_duplicate_ratio),
                    rate(c.redelivered_per_second),
                    rate(c.dead_lettered_per_second),
                ]
            })
            .collect(),
    );
}

fn markers(out: &mut String, r: &Report) {
    table(
        out,
        "Markers",
        &["at", "kind", "label", "detail"],
        r.markers
            .iter()
            .map(|m| {
                vec![
                    clock(m.at),
                    m.kind.clone(),
                    m.label.clone(),
                    m.detail.clone().unwrap_or_default(),
                ]
            })
            .collect(),
    );
}

/// Each deploy's window, one row per consumer: its duplicates against its budget.
fn deploys(out: &mut String, r: &Report) {
    table(
        out,
        "Deploys: duplicate budget per window",
        &[
            "deploy",
            "window",
            "consumer",
            "processed",
            "duplicates",
            "dup %",
            "budget",
            "verdict",
            "peak 1m",
            "baseline",
            "settled after",
        ],
        r.deploys
            .iter()
            .flat_map(|d| {
                d.consumers.iter().map(move |c| {
                    vec![
                        format!("{} {} {}", clock(d.at), d.kind, d.label),
                        format!(
                            "{} s ({})",
                            d.window_seconds,
                            match d.ends {
                                WindowEnd::NextMarker => "to the next deploy",
                                WindowEnd::SettleTime => "settle time",
                                WindowEnd::Open => "open at the poll",
                            }
                        ),
                        format!("{}/{}", c.target, c.consumer),
                        format!("{:.0}", c.processed),
                        format!("{:.0}", c.duplicates),
                        pct(c.ratio),
                        pct(Some(c.budget)),
                        c.verdict.label().to_string(),
                        pct(c.peak_ratio),
                        pct(Some(c.baseline_ratio)),
                        c.settle_seconds
                            .map_or("not settled".into(), |s| format!("{s} s")),
                    ]
                })
            })
            .collect(),
    );
}

/// Each alert with how long it held: until it ended, or (still holding) at least to
/// the window's end.
fn alerts(out: &mut String, r: &Report) {
    table(
        out,
        "Alerts in the window",
        &[
            "severity", "started", "ended", "held", "alert", "object", "cause",
        ],
        r.alerts
            .iter()
            .map(|a| {
                let until = a.ended.unwrap_or(r.to.max(a.started));
                let held = (until - a.started).to_std().unwrap_or_default();
                let held =
                    humantime::format_duration(std::time::Duration::from_secs(held.as_secs()));
                vec![
                    a.alert.severity.tag().to_string(),
                    clock(a.started),
                    a.ended.map_or("held at the window's end".into(), clock),
                    if a.ended.is_some() {
                        held.to_string()
                    } else {
                        format!("≥ {held}")
                    },
                    a.alert.message.clone(),
                    a.alert.object.label(),
                    match &a.alert.cause {
                        Cause::Incident => "incident".into(),
                        Cause::Drill { what } => format!("drill: {what}"),
                    },
                ]
            })
            .collect(),
    );
}

/// Key conflicts first (a producer bug, not an outage), then by total.
fn dead_letters(out: &mut String, r: &Report) {
    let mut dead = r.dead_letters.clone();
    dead.sort_by_key(|d| (d.reason != "key_conflict", std::cmp::Reverse(d.total)));
    table(
        out,
        "Dead letters by reason",
        &["consumer", "reason", "total", "last hour"],
        dead.iter()
            .map(|d| {
                vec![
                    d.consumer.clone(),
                    d.reason.clone(),
                    d.total.to_string(),
                    d.last_hour.to_string(),
                ]
            })
            .collect(),
    );
}

fn claims(out: &mut String, r: &Report) {
    table(
        out,
        &format!("Claims in doubt ({})", r.claims_in_doubt_total),
        &["consumer", "message key", "claimed at", "attempts"],
        r.claims_in_doubt
            .iter()
            .map(|c| {
                vec![
                    c.consumer.clone(),
                    c.message_key.clone(),
                    // A released claim's time is gone (the epoch): its retry is due.
                    if c.released {
                        "retry due".to_string()
                    } else {
                        clock(c.claimed_at)
                    },
                    c.attempts.to_string(),
                ]
            })
            .collect(),
    );
}

/// Each consumer's duplicate ages and its margin against every dedup window.
fn windows(out: &mut String, r: &Report) {
    use crate::windows::short_duration;
    let age = |s: Option<f64>| s.map_or_else(|| "-".into(), short_duration);
    table(
        out,
        "Dedup windows: duplicate age",
        &[
            "consumer",
            "duplicates",
            "p50",
            "p99",
            "oldest",
            "windows (margin)",
        ],
        r.windows
            .iter()
            .map(|w| {
                vec![
                    format!("{}/{}", w.target, w.consumer),
                    w.count.to_string(),
                    age(w.p50_seconds),
                    age(w.p99_seconds),
                    age(w.max_seconds),
                    w.summary.clone(),
                ]
            })
            .collect(),
    );
}

fn drills(out: &mut String, r: &Report) {
    table(
        out,
        "Drill verdicts",
        &["run", "scenario", "mode", "started", "verdict"],
        r.drill_runs
            .iter()
            .map(|d| {
                vec![
                    format!("#{}", d.id),
                    d.scenario.clone(),
                    d.mode.clone(),
                    d.started_at.map_or("—".into(), clock),
                    d.verdict.clone().unwrap_or_else(|| "running".into()),
                ]
            })
            .collect(),
    );
}
