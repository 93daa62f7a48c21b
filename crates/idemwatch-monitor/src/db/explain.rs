//! Reading query plans: which nodes a dashboard query runs, and whether any of them
//! reads a whole table. The bench (`idemwatch bench dashboard-queries`) reports
//! these; the plan tests fail when the dedup table is read whole.

use serde::Serialize;

/// The parts of a plan an operator (and a test) cares about.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanSummary {
    /// Every node, outermost first, e.g. `Index Only Scan on processed_messages
    /// using processed_messages_processed_at` or `range on processed_messages using …`.
    pub nodes: Vec<String>,
    /// Tables (or partitions) read whole: PostgreSQL `Seq Scan`, MySQL access type
    /// `ALL` or `index` (a full index scan is as bad at 40 million rows).
    pub full_scans: Vec<String>,
    /// `EXPLAIN ANALYZE`'s execution time, when the plan was executed.
    pub execution_ms: Option<f64>,
    /// The plan as the server printed it.
    pub plan: serde_json::Value,
}

impl PlanSummary {
    /// Whether `table`, or one of its partitions (`{table}_p…`), is read whole.
    pub fn reads_whole(&self, table: &str) -> bool {
        let partition = format!("{table}_p");
        self.full_scans
            .iter()
            .any(|t| t == table || t.starts_with(&partition))
    }
}

/// A PostgreSQL `EXPLAIN (FORMAT JSON)` document.
pub fn summarize_postgres(plan: serde_json::Value) -> PlanSummary {
    let mut nodes = Vec::new();
    let mut full_scans = Vec::new();
    let root = plan.get(0).unwrap_or(&plan);
    if let Some(p) = root.get("Plan") {
        walk_postgres(p, &mut nodes, &mut full_scans);
    }
    let execution_ms = root.get("Execution Time").and_then(|v| v.as_f64());
    PlanSummary {
        nodes,
        full_scans,
        execution_ms,
        plan,
    }
}

fn walk_postgres(node: &serde_json::Value, nodes: &mut Vec<String>, full: &mut Vec<String>) {
    let kind = node
        .get("Node Type")
        .and_then(|v| v.as_str())
        .unwrap_or("?");
    let relation = node.get("Relation Name").and_then(|v| v.as_str());
    let index = node.get("Index Name").and_then(|v| v.as_str());
    let mut text = kind.to_string();
    if let Some(r) = relation {
        text.push_str(&format!(" on {r}"));
    }
    if let Some(i) = index {
        text.push_str(&format!(" using {i}"));
    }
    nodes.push(text);
    if kind == "Seq Scan" {
        if let Some(r) = relation {
            full.push(r.to_string());
        }
    }
    if let Some(children) = node.get("Plans").and_then(|v| v.as_array()) {
        for c in children {
            walk_postgres(c, nodes, full);
        }
    }
}

/// A MySQL / MariaDB `EXPLAIN FORMAT=JSON` document: every object with a
/// `table_name` and an `access_type`, wherever the optimizer nested it.
pub fn summarize_mysql(plan: serde_json::Value) -> PlanSummary {
    let mut nodes = Vec::new();
    let mut full_scans = Vec::new();
    walk_mysql(&plan, &mut nodes, &mut full_scans);
    PlanSummary {
        nodes,
        full_scans,
        execution_ms: None,
        plan,
    }
}

fn walk_mysql(v: &serde_json::Value, nodes: &mut Vec<String>, full: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            if let (Some(table), Some(access)) = (
                map.get("table_name").and_then(|t| t.as_str()),
                map.get("access_type").and_then(|t| t.as_str()),
            ) {
                let mut text = format!("{access} on {table}");
                if let Some(key) = map.get("key").and_then(|k| k.as_str()) {
                    text.push_str(&format!(" using {key}"));
                }
                nodes.push(text);
                if access == "ALL" || access == "index" {
                    full.push(table.to_string());
                }
            } else if let Some(message) = map.get("message").and_then(|m| m.as_str()) {
                nodes.push(message.to_string());
            }
            for child in map.values() {
                walk_mysql(child, nodes, full);
            }
        }
        serde_json::Value::Array(items) => {
            for child in items {
                walk_mysql(child, nodes, full);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_seq_scan_under_an_aggregate_is_found() {
        let plan = json!([{"Plan": {"Node Type": "Aggregate", "Plans": [
            {"Node Type": "Seq Scan", "Relation Name": "processed_messages"}]},
            "Execution Time": 1.5}]);
        let s = summarize_postgres(plan);
        assert_eq!(s.nodes, ["Aggregate", "Seq Scan on processed_messages"]);
        assert!(s.reads_whole("processed_messages"));
        assert_eq!(s.execution_ms, Some(1.5));
    }

    #[test]
    fn an_index_range_is_not_a_full_scan() {
        let plan = json!([{"Plan": {"Node Type": "Limit", "Plans": [
            {"Node Type": "Index Only Scan", "Relation Name": "processed_messages",
             "Index Name": "processed_messages_processed_at"}]}}]);
        let s = summarize_postgres(plan);
        assert!(!s.reads_whole("processed_messages"));
        assert_eq!(
            s.nodes[1],
            "Index Only Scan on processed_messages using processed_messages_processed_at"
        );
    }

    #[test]
    fn a_seq_scan_of_a_partition_counts() {
        let plan = json!([{"Plan": {"Node Type": "Append", "Plans": [
            {"Node Type": "Seq Scan", "Relation Name": "processed_messages_p20261130"}]}}]);
        assert!(summarize_postgres(plan).reads_whole("processed_messages"));
    }

    #[test]
    fn mysql_access_type_all_is_found_when_nested() {
        let plan = json!({"query_block": {"select_id": 1, "filesort": {"temporary_table": {
            "table": {"table_name": "processed_messages", "access_type": "ALL"}}}}});
        let s = summarize_mysql(plan);
        assert!(s.reads_whole("processed_messages"));
        let ok = json!({"query_block": {"table": {"table_name": "processed_messages",
            "access_type": "range", "key": "processed_messages_processed_at"}}});
        assert!(!summarize_mysql(ok).reads_whole("processed_messages"));
    }
}
