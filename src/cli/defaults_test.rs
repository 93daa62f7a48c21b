//! The command line's defaults are the library's: a flag left out gives what
//! `RunnerSettings::default()` and the engine's constants say (one home per default,
//! so a library user and an operator run the same engine), and `--help` shows them.

use std::time::Duration;

use clap::{CommandFactory, Parser};

use super::{Cli, Command};
use idemwatch::engine::consumers::DEFAULT_CLAIM_LEASE;
use idemwatch::engine::http_api::ApiConfig;
use idemwatch::engine::retention::{DEFAULT_PURGE_BATCH, DEFAULT_RETENTION};
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::EngineConfig;

fn parse(args: &[&str]) -> Command {
    let argv = std::iter::once("idemwatch").chain(args.iter().copied());
    Cli::try_parse_from(argv)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .command
        .expect("a subcommand")
}

fn help(subcommand: &str) -> String {
    let mut cli = Cli::command();
    cli.find_subcommand_mut(subcommand)
        .unwrap_or_else(|| panic!("no {subcommand} subcommand"))
        .render_long_help()
        .to_string()
}

#[test]
fn a_consumer_run_without_tuning_flags_runs_the_librarys_settings() {
    let Command::Consume(consume) = parse(&["consume", "--until-idle"]) else {
        panic!("consume parsed as another command");
    };
    let url = "http://127.0.0.1:9";
    let cli = consume.engine.engine_config(url, url);
    let library = EngineConfig::new(&cli.db_url, &cli.queue_url, url, url);
    assert_eq!(cli.runner, library.runner);
    assert_eq!(cli.runner.lease_batch, 100);
    assert_eq!(cli.claim_lease, library.claim_lease);
    assert_eq!(cli.seen_set, library.seen_set);
    assert_eq!(cli.provider_concurrency, library.provider_concurrency);
    assert_eq!(cli.mode, library.mode);
}

#[test]
fn purge_claims_and_serve_default_to_the_engines_retention_lease_and_ttl() {
    let Command::Purge(purge) = parse(&["purge"]) else {
        panic!("purge parsed as another command");
    };
    let runner = RunnerSettings::default();
    assert_eq!(purge.older_than, DEFAULT_RETENTION);
    assert_eq!(purge.batch, DEFAULT_PURGE_BATCH);
    assert_eq!(purge.claim_lease, DEFAULT_CLAIM_LEASE);
    assert_eq!(purge.visibility_timeout, runner.visibility_timeout);
    assert_eq!(purge.max_deliveries, runner.max_deliveries);
    let Command::Claims(claims) = parse(&["claims", "list"]) else {
        panic!("claims parsed as another command");
    };
    let super::claims::ClaimsAction::List(list) = claims.action else {
        panic!("claims list parsed as another action");
    };
    assert_eq!(list.claim_lease, DEFAULT_CLAIM_LEASE);
    let Command::Serve(serve) = parse(&["serve"]) else {
        panic!("serve parsed as another command");
    };
    assert_eq!(serve.idempotency_ttl, ApiConfig::default().ttl);
    let database = idemwatch::config::DatabaseConfig::with_url("sqlite://x.db");
    assert_eq!(
        (database.retention, database.claim_lease),
        (DEFAULT_RETENTION, DEFAULT_CLAIM_LEASE)
    );
}

#[test]
fn help_shows_the_defaults_it_runs() {
    let runner = RunnerSettings::default();
    let consume = help("consume");
    for shown in [
        format!("[default: {}]", runner.lease_batch),
        format!("[default: {}]", runner.prefetch),
        format!("[default: {}]", runner.gather),
        "[default: 0s]".to_string(),
        "[default: 7days]".to_string(),
    ] {
        assert!(
            consume.contains(&shown),
            "consume --help lacks {shown}:\n{consume}"
        );
    }
    let purge = help("purge");
    for shown in [
        format!("[default: {}]", super::shown(DEFAULT_RETENTION)),
        format!("[default: {DEFAULT_PURGE_BATCH}]"),
        format!("[default: {}]", super::shown(DEFAULT_CLAIM_LEASE)),
        format!("[default: {}]", super::shown(runner.visibility_timeout)),
    ] {
        assert!(
            purge.contains(&shown),
            "purge --help lacks {shown}:\n{purge}"
        );
    }
    // What the parser reads back is what it showed.
    for d in [Duration::ZERO, DEFAULT_CLAIM_LEASE, DEFAULT_RETENTION] {
        assert_eq!(humantime::parse_duration(&super::shown(d)).unwrap(), d);
    }
}
