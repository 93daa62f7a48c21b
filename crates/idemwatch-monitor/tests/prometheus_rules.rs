//! The Prometheus rules shipped in `assets/prometheus/`: generated from the
//! dashboard's own thresholds, accepted by `promtool check rules`, and green under
//! their unit tests (`promtool test rules`). Without promtool the promtool checks
//! skip, unless IDEMWATCH_REQUIRE_SERVICES=1 (CI), where they fail.

use std::path::{Path, PathBuf};
use std::process::Command;

use idemwatch_monitor::promql;

const DIR: &str = "assets/prometheus";
const RULES: &str = "idemwatch.rules.yml";
const RULE_TESTS: &str = "idemwatch.rules.test.yml";

/// A file of the repository (the rules ship in its `assets/`, the README beside them).
fn asset(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn required() -> bool {
    std::env::var("IDEMWATCH_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// `promtool ARGS` in the rules' directory; None (skip) without promtool.
fn promtool(args: &[&str]) -> Option<(bool, String)> {
    let out = match Command::new("promtool")
        .args(args)
        .current_dir(asset(DIR))
        .output()
    {
        Ok(out) => out,
        Err(e) if !required() => {
            eprintln!("SKIP: promtool not available ({e})");
            return None;
        }
        Err(e) => panic!("promtool is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}"),
    };
    Some((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

/// The shipped file is exactly what the dashboard's constants generate; with
/// IDEMWATCH_BLESS=1 the test writes it instead.
#[test]
fn shipped_rules_use_the_dashboards_thresholds() {
    let generated = promql::rules_yaml();
    if std::env::var("IDEMWATCH_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(asset(DIR).join(RULES), &generated).unwrap();
    }
    let shipped = std::fs::read_to_string(asset(DIR).join(RULES)).unwrap();
    assert!(
        shipped == generated,
        "{RULES} differs from promql::rules_yaml(); regenerate with IDEMWATCH_BLESS=1 cargo test --test prometheus_rules"
    );
}

#[test]
fn promtool_checks_the_rules() {
    if let Some((ok, out)) = promtool(&["check", "rules", RULES]) {
        assert!(ok, "promtool check rules:\n{out}");
    }
}

#[test]
fn promtool_unit_tests_of_the_rules_pass() {
    if let Some((ok, out)) = promtool(&["test", "rules", RULE_TESTS]) {
        assert!(ok, "promtool test rules:\n{out}");
    }
}

/// The operations guide's table names every alert rule on the row of the dashboard
/// alert it mirrors (by the dashboard's `kind`).
#[test]
fn the_docs_list_every_alert_rule_beside_the_dashboards() {
    let readme = std::fs::read_to_string(asset("docs/OPERATIONS.md")).unwrap();
    for rule in promql::alert_rules() {
        let name = format!("`{}`", rule.alert);
        let row = readme
            .lines()
            .find(|l| l.starts_with('|') && l.contains(&name))
            .unwrap_or_else(|| {
                panic!(
                    "docs/OPERATIONS.md's rules table does not list {}",
                    rule.alert
                )
            });
        if let Some(kind) = rule.dashboard {
            let dashboard_column = row.split('|').nth(2).unwrap_or_default();
            assert!(
                dashboard_column.contains(&format!("`{kind}`")),
                "docs/OPERATIONS.md lists {} beside something other than the dashboard's `{kind}`: {row}",
                rule.alert
            );
        }
    }
}
