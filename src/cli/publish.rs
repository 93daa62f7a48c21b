//! `idemwatch publish FILE|-`: enqueue one message per line, bytes as they are.
//! Garbage lines are published too: the consumers dead-letter them with their raw
//! bytes, which is the point. A line over the envelope's size limit is not: the
//! queue refuses it (`queue::check_body_sizes`), so the file is refused whole, with
//! the line numbers, before anything is published.

use std::io::Read;
use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use super::{print_json, CliError, CliResult, EngineArgs, EXIT_OK};
use idemwatch::engine::envelope::MAX_RAW_BYTES;
use idemwatch::engine::Engine;

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// A .jsonl file, or '-' for stdin.
    pub file: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

/// Split on newlines, keep every non-blank line's exact bytes (CRLF tolerated),
/// with its line number.
pub fn split_lines(bytes: &[u8]) -> Vec<(usize, Vec<u8>)> {
    bytes
        .split(|b| *b == b'\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix(b"\r").unwrap_or(l)))
        .filter(|(_, l)| !l.iter().all(u8::is_ascii_whitespace))
        .map(|(n, l)| (n, l.to_vec()))
        .collect()
}

pub async fn run(args: PublishArgs) -> CliResult {
    let mut bytes = Vec::new();
    let read = if args.file.as_os_str() == "-" {
        std::io::stdin().read_to_end(&mut bytes).map(|_| ())
    } else {
        std::fs::read(&args.file).map(|b| bytes = b)
    };
    read.map_err(|e| CliError::usage(format!("cannot read {}: {e}", args.file.display())))?;
    let numbered = split_lines(&bytes);
    let too_large: Vec<String> = numbered
        .iter()
        .filter(|(_, l)| l.len() > MAX_RAW_BYTES)
        .map(|(n, l)| format!("line {n} ({} bytes)", l.len()))
        .collect();
    if !too_large.is_empty() {
        return Err(CliError::usage(format!(
            "{}: over the envelope limit of {MAX_RAW_BYTES} bytes; nothing was published",
            too_large.join(", ")
        )));
    }
    let lines: Vec<Vec<u8>> = numbered.into_iter().map(|(_, l)| l).collect();
    // Publishing needs no provider: the URLs are placeholders never called.
    let cfg = args
        .engine
        .engine_config("http://127.0.0.1:9", "http://127.0.0.1:9");
    let engine = Engine::open(&cfg).await.map_err(CliError::unavailable)?;
    for chunk in lines.chunks(1000) {
        engine.publish(chunk).await.map_err(CliError::unavailable)?;
    }
    let queues: Vec<String> = engine
        .consumer_names()
        .iter()
        .map(|c| engine.queue_name(c))
        .collect();
    if args.json {
        print_json(&json!({ "published": lines.len(), "queues": queues }));
    } else {
        println!(
            "published {} messages to {} ({})",
            lines.len(),
            queues.join(", "),
            engine.queue.redacted_url()
        );
    }
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::split_lines;

    #[test]
    fn blank_lines_dropped_bytes_kept() {
        let lines = split_lines(b"a\r\n\n  \n\xff\xfe garbage\nlast");
        assert_eq!(
            lines,
            vec![
                (1, b"a".to_vec()),
                (4, b"\xff\xfe garbage".to_vec()),
                (5, b"last".to_vec())
            ]
        );
    }
}
