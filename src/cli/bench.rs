//! `idemwatch bench …`: measurements at production scale on PostgreSQL (see
//! `docs/SCALE.md` for the figures and how they were taken).

use std::time::{Duration, Instant};

use clap::{Args, Subcommand};

use super::{print_json, CliError, CliResult, DurabilityArg, EXIT_OK};
use idemwatch::bench::{self, partitions, LoadPlan};
use idemwatch::engine::retention::PurgePlan;
use idemwatch::engine::runner::RunnerSettings;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchCommand,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Time every dashboard query and read its plan (optionally after --load).
    DashboardQueries(QueriesArgs),
    /// Time `purge` while a consumer writes, and report that consumer's worst stall.
    Purge(PurgeBenchArgs),
    /// SCRATCH DATABASE ONLY: replace processed_messages by daily partitions, load
    /// it, then time detaching and dropping one day while a consumer writes.
    PartitionDrop(PartitionArgs),
    /// The engine (queue + real consumer + batch transactions) against the raw SQL
    /// of the pattern on the same database, as a ratio.
    Engine(EngineArgs),
    /// The fleet trace through all four consumers until drained (an in-process
    /// sandbox provider with --provider-latency), against the raw statements of the
    /// four on the same database: msgs/s per consumer and overall, publish-to-ack
    /// latency, peak RSS, SMS/s and whether every SMS went out once.
    Pipeline(PipelineArgs),
    /// Scrape, parse and rate a 10,000-sample exposition, against a line-walk baseline.
    Scrape(ScrapeArgs),
    /// The dashboard headless against N live scrape targets: its CPU % and peak RSS.
    Tui(TuiArgs),
    /// (internal) serve N live exporters for `bench tui`.
    #[command(hide = true)]
    ServeTargets(ServeTargetsArgs),
    /// (internal) serve the exporter `bench scrape` scrapes.
    #[command(hide = true)]
    ServeExposition(ServeExpositionArgs),
}

#[derive(Debug, Args)]
pub struct ScrapeArgs {
    #[arg(long, default_value_t = 10_000)]
    pub samples: usize,
    #[arg(long, default_value_t = 200)]
    pub iterations: u32,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct TuiArgs {
    #[arg(long, default_value_t = 10)]
    pub targets: usize,
    /// Measured time (after a 3 s warm-up).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub duration: Duration,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ServeExpositionArgs {
    #[arg(long, default_value_t = 10_000)]
    pub samples: usize,
}

#[derive(Debug, Args)]
pub struct ServeTargetsArgs {
    #[arg(long, default_value_t = 10)]
    pub count: usize,
}

#[derive(Debug, Args)]
pub struct EngineArgs {
    /// Database URL (sqlite://, postgres://, mysql://).
    #[arg(long)]
    pub db: String,
    /// Queue for the engine run (default: an embedded queue in a scratch directory).
    #[arg(long)]
    pub queue: Option<String>,
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Fraction of messages that are redeliveries.
    #[arg(long, default_value_t = 0.01)]
    pub dup_rate: f64,
    /// Messages per transaction (and per lease / ack). Several sizes (`1,100`) are
    /// measured one after the other, with how throughput scales between them.
    #[arg(long, default_value = RunnerSettings::default().lease_batch.to_string(), value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Concurrent workers (engine) and connections (raw).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Raw/engine pairs to run (each on fresh keys); the median pair is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Run the engine without pipelining (each batch leased only once the one
    /// before it is acked).
    #[arg(long)]
    pub no_pipeline: bool,
    /// Deliveries the engine leases per queue round trip when pipelined, rounded up
    /// to whole batches (as `serve --prefetch`).
    #[arg(long, default_value_t = RunnerSettings::default().prefetch, value_name = "N")]
    pub prefetch: usize,
    // Both the raw baseline and the engine commit with it.
    #[command(flatten)]
    pub durability: DurabilityArg,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PipelineArgs {
    /// Database URL (sqlite://, postgres://, mysql://).
    #[arg(long)]
    pub db: String,
    /// Queue for the engine run (default: an embedded queue in a scratch directory).
    #[arg(long)]
    pub queue: Option<String>,
    /// Messages of the fleet trace (as `simulate --messages`).
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    #[arg(long, default_value_t = 50)]
    pub vehicles: usize,
    /// The trace's share of redelivered copies.
    #[arg(long, default_value_t = 0.01)]
    pub redelivery_rate: f64,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// How long the in-process sandbox provider takes per SMS or webhook (± a quarter).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s", value_name = "DURATION")]
    pub provider_latency: Duration,
    /// Provider calls in flight per side-effect consumer (as `consume`).
    #[arg(long, default_value_t = idemwatch::engine::consumers::DEFAULT_PROVIDER_CONCURRENCY, value_name = "N")]
    pub provider_concurrency: usize,
    /// Deliveries per batch (as `consume --batch`).
    #[arg(long, default_value_t = RunnerSettings::default().lease_batch, value_name = "N")]
    pub batch: usize,
    /// As `consume --prefetch`.
    #[arg(long, default_value_t = RunnerSettings::default().prefetch, value_name = "N")]
    pub prefetch: usize,
    /// As `consume --gather` (0: off).
    #[arg(long, default_value_t = RunnerSettings::default().gather, value_name = "N")]
    pub gather: usize,
    /// Messages published per second while the consumers run (default: as fast as
    /// the queue takes them, a backlog).
    #[arg(long, value_name = "PER_SECOND")]
    pub publish_rate: Option<f64>,
    /// Rounds of engine and baselines (engine first in even rounds, raw first in odd
    /// ones); the round with the median ratio is reported.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Fail an engine run that has not drained after this long.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m", value_name = "DURATION")]
    pub timeout: Duration,
    #[command(flatten)]
    pub durability: DurabilityArg,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// Rows to generate.
    #[arg(long, default_value_t = 40_000_000)]
    pub rows: i64,
    /// processed_at spreads over the last DAYS days.
    #[arg(long, default_value_t = 8)]
    pub days: i32,
    /// Rows per INSERT … SELECT FROM generate_series.
    #[arg(long, default_value_t = 1_000_000)]
    pub chunk: i64,
    /// Connections inserting at once.
    #[arg(long, default_value_t = 2)]
    pub parallel: usize,
}

impl LoadArgs {
    fn plan(&self) -> LoadPlan {
        LoadPlan {
            rows: self.rows,
            days: self.days,
            chunk: self.chunk,
            parallel: self.parallel,
        }
    }
}

#[derive(Debug, Args)]
pub struct QueriesArgs {
    /// A postgres:// database (its processed_messages is replaced with --load).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: String,
    /// Empty processed_messages and generate --rows rows first.
    #[arg(long)]
    pub load: bool,
    #[command(flatten)]
    pub load_args: LoadArgs,
    /// Timed runs per query.
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PurgeBenchArgs {
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: String,
    #[arg(long, value_parser = humantime::parse_duration, default_value = super::shown(idemwatch::engine::retention::DEFAULT_RETENTION))]
    pub older_than: Duration,
    #[arg(long, default_value_t = idemwatch::engine::retention::DEFAULT_PURGE_BATCH)]
    pub batch: i64,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    pub pause: Duration,
    #[arg(long)]
    pub max_rows: Option<u64>,
    /// record_once calls per second of the concurrent consumer.
    #[arg(long, default_value_t = 200)]
    pub writer_rate: u32,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PartitionArgs {
    /// A SCRATCH postgres:// database.
    #[arg(long)]
    pub db: String,
    #[command(flatten)]
    pub load_args: LoadArgs,
    #[arg(long, default_value_t = 200)]
    pub writer_rate: u32,
    #[arg(long)]
    pub json: bool,
}

fn err(e: bench::BenchError) -> CliError {
    match e {
        bench::BenchError::Usage(m) => CliError::usage(m),
        other => CliError::unavailable(other),
    }
}

fn print_engine_report(r: &bench::engine::EngineBenchReport) {
    println!(
        "{} on {} ({}), {} messages, {:.1}% duplicates, batch {}, {} worker(s)",
        r.backend,
        r.db,
        r.durability,
        r.messages,
        r.dup_rate * 100.0,
        r.batch,
        r.workers
    );
    for (name, f) in [("raw", &r.raw), ("engine", &r.engine)] {
        println!(
            "  {name:<6} {:>9.0} msg/s  p50 {:>7.2} ms  p99 {:>7.2} ms  cpu {:>6.1} µs/msg  ({} applied, {} duplicates, {:.2}s)",
            f.messages_per_second, f.p50_ms, f.p99_ms, f.cpu_us_per_message, f.applied, f.duplicates, f.seconds
        );
    }
    if let Some(q) = &r.queue_only {
        println!(
            "  queue alone: {:>9.0} msg/s  cpu {:>6.1} µs/msg (lease + ack, no database)",
            q.messages_per_second, q.cpu_us_per_message
        );
    }
    if let (Some(q), Some(ratio)) = (&r.raw_rusqlite, r.ratio_rusqlite) {
        println!(
            "  rusqlite raw {:>9.0} msg/s  p50 {:>7.2} ms  p99 {:>7.2} ms  cpu {:>6.1} µs/msg  (engine/rusqlite = {ratio:.2})",
            q.messages_per_second, q.p50_ms, q.p99_ms, q.cpu_us_per_message
        );
    }
    if let (Some(q), Some(ratio)) = (&r.raw_with_queue, r.ratio_with_queue) {
        println!(
            "  raw with the queue {:>9.0} msg/s  p50 {:>7.2} ms  cpu {:>6.1} µs/msg  (engine/raw-with-queue = {ratio:.2}: the engine's own code)",
            q.messages_per_second, q.p50_ms, q.cpu_us_per_message
        );
    }
    let all: Vec<String> = r.runs.iter().map(|p| format!("{:.2}", p.ratio)).collect();
    println!(
        "  engine/raw = {:.2} (median of {} pairs: {}); queue: {}, pipeline {}, {} per lease",
        r.ratio,
        r.runs.len(),
        all.join(", "),
        r.queue,
        if r.pipeline { "on" } else { "off" },
        r.lease_size
    );
}

fn print_pipeline_report(r: &bench::pipeline::PipelineBenchReport) {
    let (t, e) = (&r.trace, &r.engine);
    println!(
        "{} on {} ({}), queue {}: {} messages ({} vehicles, {} zone exits, {} ignition-offs, {} redeliveries), batch {}, provider {:.0} ms × {} in flight",
        r.backend, r.db, r.durability, r.queue, t.messages, t.vehicles, t.zone_exits,
        t.ignition_offs, t.redeliveries, r.batch, r.provider_latency_ms, r.provider_concurrency
    );
    println!(
        "  engine {:>9.0} msg/s over {:.2}s (published in {:.2}s)  publish-to-ack p50 {:.1} ms  p99 {:.1} ms  cpu {:.1} µs/msg  peak RSS {:.1} MiB (the bench's own data {:.1}, the engine's {:.1})",
        e.messages_per_second, e.seconds, e.publish_seconds, e.p50_ms, e.p99_ms, e.cpu_us_per_message, e.peak_rss_mib,
        e.bench_rss_mib, e.engine_rss_mib
    );
    for c in &e.consumers {
        println!(
            "    {:<14} {:>9.0} msg/s  {:.2}s  p50 {:>8.1} ms  p99 {:>8.1} ms  processed {}  duplicates {}  dead-lettered {}  retries {}",
            c.consumer, c.messages_per_second, c.seconds, c.p50_ms, c.p99_ms, c.processed,
            c.duplicates, c.dead_lettered, c.retries
        );
    }
    println!(
        "  SMS {} of {} at {:.0}/s, webhooks {} of {} at {:.0}/s, exactly once: {}, provider peak in flight {}",
        e.sms_sent, t.sms_expected, e.sms_per_second, e.webhooks_sent, t.webhooks_expected,
        e.webhooks_per_second, e.exactly_once, e.provider_peak_in_flight
    );
    println!(
        "  raw (sqlx) {:>9.0} msg/s over {:.2}s  cpu {:.1} µs/msg  engine/raw = {:.2}",
        r.raw.messages_per_second, r.raw.seconds, r.raw.cpu_us_per_message, r.ratio
    );
    if let (Some(q), Some(ratio)) = (&r.raw_rusqlite, r.ratio_rusqlite) {
        println!(
            "  raw (rusqlite) {:>9.0} msg/s over {:.2}s  cpu {:.1} µs/msg  engine/rusqlite = {ratio:.2}",
            q.messages_per_second, q.seconds, q.cpu_us_per_message
        );
    }
}

fn say(message: &str) {
    eprintln!("{message}");
}

pub async fn run(args: BenchArgs) -> CliResult {
    match args.what {
        BenchCommand::Scrape(a) => {
            let exe = std::env::current_exe().map_err(CliError::unavailable)?;
            let r = bench::scrape::run(&exe, a.samples, a.iterations)
                .await
                .map_err(err)?;
            if a.json {
                print_json(&r);
            } else {
                println!(
                    "{} samples ({} bytes), {} iterations: baseline {:.0} µs, parse {:.0} µs ({:.1}×), parse+rates {:.0} µs, HTTP scrape+parse {:.0} µs, HTTP scrape+parse+rates {:.0} µs ({:.1}×; dashboard CPU {:.0} µs; exporter encode {:.0} µs)",
                    r.samples, r.bytes, r.iterations, r.baseline_us, r.parse_us, r.parse_vs_baseline,
                    r.parse_and_rates_us, r.http_scrape_parse_us, r.http_scrape_us, r.scrape_vs_baseline,
                    r.http_scrape_cpu_us, r.exporter_encode_us
                );
            }
            Ok(EXIT_OK)
        }
        BenchCommand::Tui(a) => {
            let exe = std::env::current_exe().map_err(CliError::unavailable)?;
            let r = bench::tui::run(&exe, a.targets, a.duration)
                .await
                .map_err(err)?;
            if a.json {
                print_json(&r);
            } else {
                println!(
                    "dashboard headless, {} targets at 1 s: {:.2}% CPU of one core over {:.0}s ({} snapshots, {} frames), peak RSS {:.1} MiB",
                    r.targets, r.cpu_percent, r.seconds, r.snapshots, r.frames, r.peak_rss_mib
                );
            }
            Ok(EXIT_OK)
        }
        BenchCommand::ServeTargets(a) => {
            bench::tui::serve_targets(a.count).await.map_err(err)?;
            Ok(EXIT_OK)
        }
        BenchCommand::ServeExposition(a) => {
            bench::scrape::serve_exposition(a.samples)
                .await
                .map_err(err)?;
            Ok(EXIT_OK)
        }
        BenchCommand::Engine(a) => {
            let plan = bench::engine::EngineBenchPlan {
                db_url: a.db.clone(),
                queue_url: a.queue.clone(),
                messages: a.messages,
                dup_rate: a.dup_rate,
                batch: a.batch.first().copied().unwrap_or(100),
                workers: a.workers,
                seed: a.seed,
                runs: a.runs,
                pipeline: !a.no_pipeline,
                prefetch: a.prefetch,
                durability: a.durability.durability,
            };
            if a.batch.len() > 1 {
                let r = bench::engine::run_sizes(&plan, &a.batch)
                    .await
                    .map_err(err)?;
                if a.json {
                    print_json(&r);
                } else {
                    r.batches.iter().for_each(print_engine_report);
                    for s in &r.scaling {
                        println!(
                            "batch {} vs batch {}: engine x{:.1}, raw x{:.1}",
                            s.to_batch, s.from_batch, s.engine, s.raw
                        );
                    }
                }
                return Ok(EXIT_OK);
            }
            let r = bench::engine::run(&plan).await.map_err(err)?;
            if a.json {
                print_json(&r);
            } else {
                print_engine_report(&r);
            }
            Ok(EXIT_OK)
        }
        BenchCommand::Pipeline(a) => {
            let plan = bench::pipeline::PipelineBenchPlan {
                db_url: a.db.clone(),
                queue_url: a.queue.clone(),
                messages: a.messages,
                vehicles: a.vehicles,
                redelivery_rate: a.redelivery_rate,
                seed: a.seed,
                provider_latency: a.provider_latency,
                provider_concurrency: a.provider_concurrency.max(1),
                publish_rate: a.publish_rate,
                runner: RunnerSettings {
                    lease_batch: a.batch.max(1),
                    prefetch: a.prefetch,
                    gather: a.gather,
                    ..RunnerSettings::default()
                },
                durability: a.durability.durability,
                runs: a.runs,
                timeout: a.timeout,
            };
            let r = bench::pipeline::run(&plan).await.map_err(err)?;
            if a.json {
                print_json(&r);
            } else {
                print_pipeline_report(&r);
            }
            Ok(EXIT_OK)
        }
        BenchCommand::DashboardQueries(a) => {
            let load = if a.load {
                Some(
                    bench::load(&a.db, a.load_args.plan(), say)
                        .await
                        .map_err(err)?,
                )
            } else {
                None
            };
            let report = bench::dashboard_queries(&a.db, a.runs).await.map_err(err)?;
            if a.json {
                print_json(&serde_json::json!({"load": load, "dashboard": report}));
            } else {
                if let Some(l) = &load {
                    println!(
                        "loaded {} rows over {} days in {:.1}s (insert {:.1}s, indexes {:.1}s, vacuum+analyze {:.1}s); table {} MiB, indexes {} MiB",
                        l.rows, l.days, l.total_seconds, l.insert_seconds, l.index_seconds,
                        l.vacuum_analyze_seconds, l.table_bytes >> 20, l.index_bytes >> 20
                    );
                }
                println!("{} (estimated rows {:?})", report.db, report.estimated_rows);
                for q in &report.queries {
                    println!(
                        "  {:<26} median {:>8.2} ms  max {:>8.2} ms  {}{}",
                        q.name,
                        q.median_ms,
                        q.max_ms,
                        q.plan_nodes.join(" > "),
                        if q.seq_scan_of_processed_messages {
                            "  SEQ SCAN!"
                        } else {
                            ""
                        }
                    );
                }
                println!(
                    "  whole poll (every section)  median {:.2} ms  max {:.2} ms",
                    report.full_poll_median_ms, report.full_poll_max_ms
                );
            }
            Ok(EXIT_OK)
        }
        BenchCommand::Purge(a) => {
            let plan = PurgePlan {
                cutoff: bench::cutoff(a.older_than).map_err(err)?,
                batch: a.batch,
                pause: a.pause,
                max_rows: a.max_rows,
            };
            let mut last = Instant::now();
            let report = bench::purge_under_load(&a.db, plan, a.writer_rate, |p| {
                if last.elapsed() >= Duration::from_secs(5) {
                    last = Instant::now();
                    eprintln!(
                        "  {} rows in {} batches, {:.0} rows/s, last batch {:.1} ms",
                        p.deleted, p.batches, p.rows_per_second, p.last_batch_ms
                    );
                }
            })
            .await
            .map_err(err)?;
            if a.json {
                print_json(&report);
            } else {
                let (p, w) = (&report.purge, &report.writer_during_purge);
                println!(
                    "purged {} rows in {} batches in {:.1}s ({:.0} rows/s, slowest batch {:.1} ms)",
                    p.deleted, p.batches, p.seconds, p.rows_per_second, p.slowest_batch_ms
                );
                println!(
                    "writer at {}/s: {} calls, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, {} over 100 ms, {} errors",
                    w.target_per_second, w.calls, w.p50_ms, w.p99_ms, w.max_ms, w.over_100ms, w.errors
                );
            }
            Ok(EXIT_OK)
        }
        BenchCommand::PartitionDrop(a) => {
            let report = partitions::partition_drop(&a.db, a.load_args.plan(), a.writer_rate, say)
                .await
                .map_err(err)?;
            if a.json {
                print_json(&report);
            } else {
                let w = &report.writer_during_drop;
                println!(
                    "{}: {} rows; DETACH CONCURRENTLY {:.1} ms, DROP {:.1} ms; writer max {:.2} ms (p99 {:.2} ms); duplicate across days accepted: {}",
                    report.partition, report.partition_rows, report.detach_concurrently_ms,
                    report.drop_ms, w.max_ms, w.p99_ms, report.duplicate_across_days_accepted
                );
            }
            Ok(EXIT_OK)
        }
    }
}
