//! The report as one CSV table: a `section` column says which part a row belongs
//! to (point, consumer, marker, deploy, alert, dead_letters, claim, drill), so one file
//! loads into a spreadsheet and filters by section.

use std::fmt::Write;

use super::Report;

/// A CSV field, quoted when it must be.
fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

pub fn table(r: &Report) -> String {
    let mut out = String::from("section,time,target,consumer,name,value,detail\n");
    let mut row = |cells: [&str; 7]| {
        let line: Vec<String> = cells.iter().map(|c| field(c)).collect();
        let _ = writeln!(out, "{}", line.join(","));
    };
    for c in &r.consumers {
        row([
            "consumer",
            "",
            &c.target,
            &c.consumer,
            "duplicate_ratio",
            &opt(c.duplicate_ratio),
            &format!(
                "processed_per_second={} duplicate_dropped_per_second={} redelivered_per_second={} dead_lettered_per_second={}",
                opt(c.processed_per_second),
                opt(c.duplicate_dropped_per_second),
                opt(c.redelivered_per_second),
                opt(c.dead_lettered_per_second)
            ),
        ]);
        for p in &c.points {
            let t = p.t.to_string();
            for (name, v) in [
                ("duplicate_ratio", p.duplicate_ratio),
                ("processed_per_second", p.processed_per_second),
                (
                    "duplicate_dropped_per_second",
                    p.duplicate_dropped_per_second,
                ),
                ("redelivered_per_second", p.redelivered_per_second),
                ("dead_lettered_per_second", p.dead_lettered_per_second),
            ] {
                row(["point", &t, &c.target, &c.consumer, name, &opt(v), ""]);
            }
        }
    }
    for m in &r.markers {
        row([
            "marker",
            &m.at.to_rfc3339(),
            "",
            "",
            &m.kind,
            &m.label,
            m.detail.as_deref().unwrap_or(""),
        ]);
    }
    for d in &r.deploys {
        for c in &d.consumers {
            row([
                "deploy",
                &d.at.to_rfc3339(),
                &c.target,
                &c.consumer,
                &d.label,
                &opt(c.ratio),
                &format!(
                    "kind={} until={} ends={} processed={} duplicates={} budget={} verdict={} peak_ratio={} baseline_ratio={} settle_seconds={}",
                    d.kind,
                    d.until.to_rfc3339(),
                    d.ends.as_str(),
                    c.processed,
                    c.duplicates,
                    c.budget,
                    c.verdict.as_str(),
                    opt(c.peak_ratio),
                    c.baseline_ratio,
                    c.settle_seconds.map(|s| s.to_string()).unwrap_or_default()
                ),
            ]);
        }
    }
    for a in &r.alerts {
        row([
            "alert",
            &a.started.to_rfc3339(),
            "",
            "",
            a.alert.kind.name(),
            a.alert.severity.tag(),
            &a.alert.message,
        ]);
    }
    for d in &r.dead_letters {
        row([
            "dead_letters",
            "",
            "",
            &d.consumer,
            &d.reason,
            &d.total.to_string(),
            "",
        ]);
    }
    for c in &r.claims_in_doubt {
        row([
            "claim",
            &c.claimed_at.to_rfc3339(),
            "",
            &c.consumer,
            &c.message_key,
            &c.attempts.to_string(),
            "",
        ]);
    }
    for d in &r.drill_runs {
        row([
            "drill",
            &d.started_at.map(|s| s.to_rfc3339()).unwrap_or_default(),
            "",
            "",
            &d.scenario,
            d.verdict.as_deref().unwrap_or("running"),
            &d.mode,
        ]);
    }
    out
}
