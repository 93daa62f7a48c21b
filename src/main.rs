//! The `idemwatch` binary: parse arguments, set up logging to a file, call a layer.

mod cli;

/// mimalloc instead of glibc's malloc: the engine allocates and frees small buffers per
/// delivery (bodies, parsed envelopes, keys) across threads, and glibc spent ~11 % of the
/// SQLite pipeline's CPU in malloc/free and its consolidation. Measured in BENCHMARKS.md
/// ("mimalloc landed, built without transparent huge pages"): ~11 % more msg/s, 10-16 % less
/// CPU per message.
///
/// Built with `no_thp`: with transparent huge pages mimalloc backs its arenas with 2 MiB
/// pages, and a scrape of an endless line then added ~14 MiB of peak RSS instead of ~4,
/// past what `tests/scrape_limits.rs` allows (the dashboard's memory is capped against
/// hostile targets; that promise is the allocator's too).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use clap::Parser;

use cli::{Cli, Command};

/// Logs go to a file: the terminal belongs to the TUI, stdout to --json output.
fn init_logging(path: Option<PathBuf>) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    let path = path.unwrap_or_else(|| idemwatch::engine::default_data_dir().join("idemwatch.log"));
    let dir = path.parent()?.to_path_buf();
    std::fs::create_dir_all(&dir).ok()?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .ok()?;
    let (writer, guard) = tracing_appender::non_blocking(file);
    let filter = tracing_subscriber::EnvFilter::try_from_env("IDEMWATCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false)
        .init();
    Some(guard)
}

/// The data directory exists and is private (0700), and whatever this process
/// creates (SQLite files, the queue, the log, reports) is readable by its owner only:
/// the files hold message payloads, phone numbers and dead letters' raw bytes.
fn private_files() -> Result<(), String> {
    // SAFETY: umask only changes this process's file-creation mask; it cannot fail.
    unsafe {
        libc::umask(0o077);
    }
    let dir = idemwatch::engine::data_dir().map_err(|e| e.to_string())?;
    idemwatch::engine::make_private_dir(&dir)
        .map_err(|e| format!("cannot create the data directory {}: {e}", dir.display()))
}

/// Exit with a command's result, its error on stderr.
fn exit_with(result: cli::CliResult) -> ! {
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", e.message);
            std::process::exit(e.code)
        }
    }
}

fn main() {
    // Before parsing (the flags read these variables) and before any thread starts.
    if let Err(e) = cli::env_files::load() {
        exit_with(Err(e));
    }
    let cli = Cli::parse();
    // Written from the argument definitions alone, before the data directory, the
    // log and the runtime: packagers run these in build sandboxes without a home.
    match &cli.command {
        Some(Command::Completions(a)) => exit_with(cli::completions::run(a)),
        Some(Command::Man(a)) => exit_with(cli::man::run(a)),
        _ => {}
    }
    if let Err(e) = private_files() {
        eprintln!("error: {e}");
        std::process::exit(cli::EXIT_USAGE);
    }
    let _guard = init_logging(cli.log_file.clone());
    let mut builder = match cli::runtime_threads(cli.runtime_threads) {
        // One thread: tokio's current-thread scheduler. A multi-thread runtime with one
        // worker still hands every wake-up between the worker and the thread in
        // `block_on`, and on a small VM those hand-offs cost more than the work.
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(3);
        }
    };
    let config_path = cli.config.clone();
    let result = runtime.block_on(async move {
        match cli.command {
            Some(Command::Serve(a)) => cli::serve::run(a, config_path).await,
            Some(Command::Publish(a)) => cli::publish::run(a).await,
            Some(Command::Consume(a)) => cli::consume::run(a, config_path).await,
            Some(Command::Drill(a)) => cli::drill::run(a).await,
            Some(Command::Snapshot(a)) => cli::snapshot::run(a, config_path).await,
            Some(Command::Mark(a)) => cli::mark::run(a, config_path).await,
            Some(Command::Purge(a)) => cli::purge::run(a).await,
            Some(Command::DeadLetters(a)) => cli::dead_letters::run(a).await,
            Some(Command::Claims(a)) => cli::claims::run(a).await,
            Some(Command::Report(a)) => cli::report::run(a, config_path).await,
            Some(Command::SmsSandbox(a)) => cli::sandbox::run(a).await,
            Some(Command::Simulate(a)) => cli::simulate::run(a).await,
            Some(Command::Bench(a)) => cli::bench::run(a).await,
            Some(Command::Chaos(a)) => cli::chaos::run(a).await,
            Some(Command::Ingest(a)) => cli::ingest::run(a).await,
            // Answered above, before the data directory; listed for the match.
            Some(Command::Completions(a)) => cli::completions::run(&a),
            Some(Command::Man(a)) => cli::man::run(&a),
            None => {
                cli::dashboard::run(config_path, cli.prometheus.clone(), cli.scrape_cap.clone())
                    .await
            }
        }
    });
    let code = match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", e.message);
            tracing::error!(code = e.code, "{}", e.message);
            e.code
        }
    };
    drop(_guard);
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    std::process::exit(code);
}
