//! Scraping `/metrics` endpoints and parsing the text exposition.
//!
//! # Why our own parser
//!
//! We read two dialects: the classic Prometheus text format (0.0.4) and the
//! OpenMetrics text that `prometheus-client` (our own engine) emits, with `# EOF`,
//! `_total` counter samples under a `# TYPE name counter` family and `_created`
//! samples. The crates considered:
//!
//! - `prometheus-parse` (and `prometheus-scrape`, which it copies): regex per line over
//!   an iterator of owned `String`s, no notion of `# EOF` or OpenMetrics timestamps
//!   in seconds, few releases in years.
//! - `openmetrics-parser`: a pest grammar, LGPL-3.0 (awkward for a statically
//!   linked MIT binary), rejects text that is not exactly one of the two dialects.
//!
//! The format is line-based and small: name, optional `{labels}` with three escapes,
//! value (`+Inf`, `NaN`…), optional timestamp. A hand parser with tests
//! reads both dialects and, on an engine's exposition, allocates nothing per sample:
//! a name is allocated once per exposition and shared by its samples, a short label
//! set lives inside its sample. 10,000 samples parse in ~0.7 ms optimised on our
//! 2-core dev machine (see `bench scrape` in BENCHMARKS.md and
//! `tests/monitor_prometheus.rs`).
//!
//! Like Prometheus itself we refuse a whole exposition on the first malformed line
//! (with its line number): a half-read scrape would show wrong rates.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

/// A malformed exposition line, or one past a [`ScrapeLimits`] cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
    /// The exposition went past a cap (a line, the sample count): not malformed,
    /// too large to read.
    pub too_large: bool,
}

impl ParseError {
    fn malformed(line: usize, message: String) -> ParseError {
        ParseError {
            line,
            message,
            too_large: false,
        }
    }
}

/// What one scrape may cost, whatever the target sends. A target is someone
/// else's process: one that streams an endless line, or a gigantic page, must
/// show as down ("response too large"), not take the dashboard's memory. With the
/// defaults a scrape holds at most the body cap in flight plus
/// `max_samples` parsed samples (about 100 bytes each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrapeLimits {
    /// Bytes of one response body (after any decoding).
    pub max_body_bytes: u64,
    /// Bytes of one line: an unfinished line is buffered until its end arrives.
    pub max_line_bytes: usize,
    /// Samples of one exposition.
    pub max_samples: usize,
}

/// 16 MiB: a hundred times an engine's exposition, and what a large exporter
/// (RabbitMQ with per-object metrics) serves.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 16 << 20;
/// Prometheus has no line limit; label values this long are not metrics.
pub const DEFAULT_MAX_LINE_BYTES: usize = 1 << 20;
/// An engine exposes a few hundred samples; 200,000 parsed samples are ~20 MB.
pub const DEFAULT_MAX_SAMPLES: usize = 200_000;

impl Default for ScrapeLimits {
    fn default() -> Self {
        ScrapeLimits {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            max_samples: DEFAULT_MAX_SAMPLES,
        }
    }
}

/// The `# TYPE` of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Untyped,
    /// OpenMetrics-only types (`info`, `stateset`, `gaugehistogram`, `unknown`).
    Other,
}

/// One sample line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Shared by every sample of the same name in one exposition (one allocation per
    /// distinct name, not per line).
    pub name: Arc<str>,
    pub labels: Labels,
    pub value: f64,
    /// As written: milliseconds in Prometheus text, seconds in OpenMetrics. We never
    /// use it for rates (the scrape time is what we observed), only keep it.
    pub timestamp: Option<f64>,
}

impl Sample {
    /// The value of one label, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name)
    }
}

/// Label sets up to this many bytes (`key NUL value NUL …`) live inside the sample:
/// an engine's (`consumer`, `reason`, `le`…) all do, so parsing them allocates nothing.
const INLINE_LABELS: usize = 62;

/// The labels of one sample, unescaped, in one buffer (`key NUL value NUL …`): inside
/// the sample when short (no allocation), in one heap block otherwise.
#[derive(Clone)]
pub struct Labels {
    repr: LabelsRepr,
}

#[derive(Clone)]
enum LabelsRepr {
    Inline { len: u8, bytes: [u8; INLINE_LABELS] },
    Heap(Box<str>),
}

impl Default for Labels {
    fn default() -> Self {
        Labels {
            repr: LabelsRepr::Inline {
                len: 0,
                bytes: [0; INLINE_LABELS],
            },
        }
    }
}

impl Labels {
    fn from_buf(buf: &str) -> Labels {
        let repr = match u8::try_from(buf.len()) {
            Ok(len) if buf.len() <= INLINE_LABELS => {
                let mut bytes = [0; INLINE_LABELS];
                bytes[..buf.len()].copy_from_slice(buf.as_bytes());
                LabelsRepr::Inline { len, bytes }
            }
            _ => LabelsRepr::Heap(buf.into()),
        };
        Labels { repr }
    }

    /// The whole label set as one string (`key NUL value NUL …`, in exposition order):
    /// tells two label sets apart (NUL is refused in values) without allocating, so
    /// it serves as a map key.
    pub fn as_key(&self) -> &str {
        match &self.repr {
            // Always a copy of a whole `&str` (see `from_buf`): the check cannot fail.
            LabelsRepr::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default()
            }
            LabelsRepr::Heap(buf) => buf,
        }
    }

    /// (name, value) pairs in exposition order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut rest = self.as_key();
        // A byte loop: the parts are a few bytes long, too short for `split`'s memchr.
        let mut next_part = move || {
            let end = rest.bytes().position(|b| b == 0).unwrap_or(rest.len());
            let part = &rest[..end];
            rest = rest.get(end + 1..).unwrap_or("");
            part
        };
        std::iter::from_fn(move || {
            let key = Some(next_part()).filter(|k| !k.is_empty())?;
            Some((key, next_part()))
        })
    }

    /// One label's value: exporters order labels freely, so look it up by name.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| v)
    }

    /// True for an unlabelled sample (`process_start_time_seconds`).
    pub fn is_empty(&self) -> bool {
        self.as_key().is_empty()
    }
}

impl PartialEq for Labels {
    fn eq(&self, other: &Self) -> bool {
        self.as_key() == other.as_key()
    }
}

impl Eq for Labels {}

impl std::fmt::Debug for Labels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Labels {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

/// One parsed exposition.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Exposition {
    pub samples: Vec<Sample>,
    /// Family name → type, from `# TYPE` lines.
    pub types: HashMap<String, MetricType>,
    /// The OpenMetrics terminator was present.
    pub saw_eof: bool,
}

impl Exposition {
    /// Every sample with this exact name.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.runs()
            .filter(move |run| &*run[0].name == name)
            .flatten()
    }

    /// The samples as runs of consecutive samples of one name (a family's lines, the
    /// `_bucket`s of one histogram…), in exposition order: what a reader looking for
    /// a few names compares, rather than every line.
    pub fn runs(&self) -> impl Iterator<Item = &[Sample]> {
        // Equal names of one parse share one allocation: `Arc`'s `==` compares the
        // pointers first, so walking a run costs no string comparison.
        self.samples.chunk_by(|a, b| a.name == b.name)
    }

    /// The runs grouped once, for a reader that looks up several names: each lookup
    /// then compares one name per run instead of one per sample.
    pub fn by_name(&self) -> ByName<'_> {
        ByName {
            runs: self.runs().collect(),
        }
    }

    /// The first sample with this name (for unlabelled gauges such as
    /// `process_start_time_seconds`).
    pub fn first(&self, name: &str) -> Option<f64> {
        self.named(name).next().map(|s| s.value)
    }

    /// The type of the family a sample belongs to: OpenMetrics types the family
    /// (`foo`) while the sample is `foo_total`, `foo_created`, `foo_bucket`…
    pub fn type_of(&self, sample_name: &str) -> Option<MetricType> {
        if let Some(t) = self.types.get(sample_name) {
            return Some(*t);
        }
        ["_total", "_created", "_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| sample_name.strip_suffix(suffix))
            .find_map(|family| self.types.get(family).copied())
    }
}

/// An exposition's samples grouped into runs of one name, see [`Exposition::by_name`].
#[derive(Debug, Clone)]
pub struct ByName<'e> {
    runs: Vec<&'e [Sample]>,
}

impl<'e> ByName<'e> {
    /// Every sample with this exact name, in exposition order (as
    /// [`Exposition::named`]).
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'e Sample> + 'a {
        self.runs
            .iter()
            .filter(move |run| &*run[0].name == name)
            .flat_map(|run| run.iter())
    }

    /// The first sample's value with this name (as [`Exposition::first`]).
    pub fn first(&self, name: &str) -> Option<f64> {
        self.named(name).next().map(|s| s.value)
    }
}

/// What one parse reuses from line to line: the names seen so far (one `Arc` each)
/// and the buffer labels are unescaped into.
#[derive(Default)]
struct ParseState {
    names: HashSet<Arc<str>>,
    current: Option<Arc<str>>,
    labels: String,
}

impl ParseState {
    /// The name starting at `start` (a name character) and the position after it,
    /// shared: the previous line's when this line repeats it (the usual case, found
    /// without a scan), else the one interned for it.
    fn name_at(&mut self, line: &str, start: usize) -> (Arc<str>, usize) {
        let bytes = line.as_bytes();
        if let Some(current) = &self.current {
            let end = start + current.len();
            if bytes.get(start..end) == Some(current.as_bytes())
                && !bytes.get(end).is_some_and(|&b| is_name_char(b))
            {
                return (current.clone(), end);
            }
        }
        let end = name_end(bytes, start);
        let text = &line[start..end];
        let name = match self.names.get(text) {
            Some(name) => name.clone(),
            None => {
                let name: Arc<str> = Arc::from(text);
                self.names.insert(name.clone());
                name
            }
        };
        self.current = Some(name.clone());
        (name, end)
    }
}

/// Parse a Prometheus or OpenMetrics text exposition (with the default
/// [`ScrapeLimits`] on lines and samples).
pub fn parse(text: &str) -> Result<Exposition, ParseError> {
    let mut parser = Parser::default();
    parser.lines(text)?;
    Ok(parser.out)
}

/// A parse fed with a body's pieces as they arrive ([`Parser::feed`]), so that the
/// lines already received are parsed while the exporter is still encoding the
/// rest. Gives the same exposition, and the same error at the same line, as
/// [`parse`] of the whole body.
#[derive(Default)]
pub struct Parser {
    out: Exposition,
    state: ParseState,
    /// Lines parsed so far, for the error's line number.
    line: usize,
    /// The start of a line whose end has not arrived yet.
    pending: Vec<u8>,
    limits: ScrapeLimits,
}

impl Parser {
    /// A parser that refuses lines and sample counts past `limits` (the body cap is
    /// the reader's: see [`Scraper`]).
    pub fn with_limits(limits: ScrapeLimits) -> Parser {
        Parser {
            limits,
            ..Parser::default()
        }
    }

    fn too_large(&self, line: usize, message: String) -> ParseError {
        ParseError {
            line,
            message,
            too_large: true,
        }
    }

    /// An unfinished line past the cap is refused before more of it is kept.
    fn check_pending(&self) -> Result<(), ParseError> {
        if self.pending.len() > self.limits.max_line_bytes {
            return Err(self.too_large(
                self.line + 1,
                format!("a line longer than {} bytes", self.limits.max_line_bytes),
            ));
        }
        Ok(())
    }

    /// Parse the complete lines of what arrived, keeping an incomplete last line
    /// for the next piece. A line never splits a UTF-8 character: a piece's
    /// complete lines are checked (invalid bytes become U+FFFD) on their own.
    pub fn feed(&mut self, piece: &[u8]) -> Result<(), ParseError> {
        let mut piece = piece;
        if !self.pending.is_empty() {
            let Some(end) = memchr::memchr(b'\n', piece) else {
                self.pending.extend_from_slice(piece);
                return self.check_pending();
            };
            self.pending.extend_from_slice(&piece[..end]);
            let line = std::mem::take(&mut self.pending);
            self.complete_lines(&line)?;
            self.pending = line;
            self.pending.clear();
            piece = &piece[end + 1..];
        }
        match memchr::memrchr(b'\n', piece) {
            Some(end) => {
                self.complete_lines(&piece[..end])?;
                self.pending.extend_from_slice(&piece[end + 1..]);
            }
            None => self.pending.extend_from_slice(piece),
        }
        self.check_pending()
    }

    /// The body ended: parse its last line (one without a newline) and give the
    /// exposition.
    pub fn finish(mut self) -> Result<Exposition, ParseError> {
        let last = std::mem::take(&mut self.pending);
        if !last.is_empty() {
            self.complete_lines(&last)?;
        }
        Ok(self.out)
    }

    /// Lines whose ends arrived, without the last newline.
    fn complete_lines(&mut self, bytes: &[u8]) -> Result<(), ParseError> {
        match std::str::from_utf8(bytes) {
            Ok(text) => self.lines(text),
            Err(_) => self.lines(&String::from_utf8_lossy(bytes)),
        }
    }

    /// Parse each line of `text` (split on `\n`, the last one included whatever it
    /// ends with). Lines after the OpenMetrics terminator are ignored.
    fn lines(&mut self, text: &str) -> Result<(), ParseError> {
        for raw in split_lines(text) {
            if self.out.saw_eof {
                break;
            }
            self.line += 1;
            if raw.len() > self.limits.max_line_bytes {
                return Err(self.too_large(
                    self.line,
                    format!("a line longer than {} bytes", self.limits.max_line_bytes),
                ));
            }
            self.line_of(raw)
                .map_err(|message| ParseError::malformed(self.line, message))?;
            if self.out.samples.len() > self.limits.max_samples {
                return Err(self.too_large(
                    self.line,
                    format!("more than {} samples", self.limits.max_samples),
                ));
            }
        }
        Ok(())
    }

    fn line_of(&mut self, raw: &str) -> Result<(), String> {
        let out = &mut self.out;
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        // A line starting with a name or `#` is not blank: no need to trim it.
        let starts_visible = line
            .as_bytes()
            .first()
            .is_some_and(|b| b.is_ascii_graphic());
        if !starts_visible && line.trim().is_empty() {
            return Ok(());
        }
        if let Some(comment) = line.strip_prefix('#') {
            let comment = comment.trim_start();
            if comment.trim_end() == "EOF" {
                out.saw_eof = true;
                return Ok(());
            }
            if let Some(rest) = comment.strip_prefix("TYPE ") {
                let mut parts = rest.split_whitespace();
                let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                    return Err("TYPE line without a name and a type".into());
                };
                out.types.insert(name.to_string(), metric_type(kind));
            }
            // HELP, UNIT and free comments carry nothing we chart.
            return Ok(());
        }
        out.samples.push(parse_sample(line, &mut self.state)?);
        Ok(())
    }
}

/// `text.split('\n')` by `memchr`: std's char search compares each match with a
/// function call, a tenth of the parse.
fn split_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let current = rest?;
        match memchr::memchr(b'\n', current.as_bytes()) {
            Some(end) => {
                rest = Some(&current[end + 1..]);
                Some(&current[..end])
            }
            None => {
                rest = None;
                Some(current)
            }
        }
    })
}

fn metric_type(kind: &str) -> MetricType {
    match kind {
        "counter" => MetricType::Counter,
        "gauge" => MetricType::Gauge,
        "histogram" => MetricType::Histogram,
        "summary" => MetricType::Summary,
        "untyped" => MetricType::Untyped,
        _ => MetricType::Other,
    }
}

/// `[a-zA-Z0-9_:]`, by table: this test runs on every byte of every name.
const NAME_CHAR: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'_' || c == b':';
        b += 1;
    }
    table
};

fn is_name_start(b: u8) -> bool {
    NAME_CHAR[usize::from(b)] && !b.is_ascii_digit()
}

fn is_name_char(b: u8) -> bool {
    NAME_CHAR[usize::from(b)]
}

/// The end of the name starting at `pos`.
fn name_end(bytes: &[u8], mut pos: usize) -> usize {
    while pos < bytes.len() && is_name_char(bytes[pos]) {
        pos += 1;
    }
    pos
}

fn parse_sample(line: &str, state: &mut ParseState) -> Result<Sample, String> {
    let bytes = line.as_bytes();
    let mut pos = 0;
    while pos < bytes.len() && (bytes[pos] == b' ' || bytes[pos] == b'\t') {
        pos += 1;
    }
    if pos >= bytes.len() || !is_name_start(bytes[pos]) {
        return Err("expected a metric name".into());
    }
    let (name, end) = state.name_at(line, pos);
    pos = end;
    let mut labels = Labels::default();
    if bytes.get(pos) == Some(&b'{') {
        state.labels.clear();
        pos = parse_labels(line, pos + 1, &mut state.labels)?;
        labels = Labels::from_buf(&state.labels);
    }
    // An OpenMetrics exemplar (` # {…} v`) follows the value and timestamp.
    let rest = &line[pos..];
    // After the labels a `#` can only start an exemplar (a byte search: a substring
    // search per line costs more than the rest of the line's parse).
    let rest = rest
        .bytes()
        .position(|b| b == b'#')
        .map_or(rest, |i| &rest[..i]);
    let mut fields = rest.split_ascii_whitespace();
    let value_text = fields
        .next()
        .ok_or_else(|| format!("{name}: missing value"))?;
    let value =
        parse_float(value_text).ok_or_else(|| format!("{name}: bad value {value_text:?}"))?;
    let timestamp = match fields.next() {
        None => None,
        Some(t) => Some(parse_float(t).ok_or_else(|| format!("{name}: bad timestamp {t:?}"))?),
    };
    if let Some(extra) = fields.next() {
        return Err(format!("{name}: unexpected {extra:?} after the timestamp"));
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp,
    })
}

/// Parse `name="value",…}` starting after `{` into `buf` (`key NUL value NUL …`,
/// unescaped); returns the position after `}`.
fn parse_labels(line: &str, mut pos: usize, buf: &mut String) -> Result<usize, String> {
    let bytes = line.as_bytes();
    let skip_ws = |mut p: usize| {
        while p < bytes.len() && (bytes[p] == b' ' || bytes[p] == b'\t') {
            p += 1;
        }
        p
    };
    loop {
        pos = skip_ws(pos);
        match bytes.get(pos) {
            Some(b'}') => return Ok(pos + 1),
            Some(&b) if is_name_start(b) => {}
            _ => {
                return Err(format!(
                    "expected a label name or '}}' at column {}",
                    pos + 1
                ))
            }
        }
        let start = pos;
        pos = name_end(bytes, pos);
        let key = &line[start..pos];
        buf.push_str(key);
        buf.push('\0');
        pos = skip_ws(pos);
        if bytes.get(pos) != Some(&b'=') {
            return Err(format!("label {key}: expected '='"));
        }
        pos = skip_ws(pos + 1);
        if bytes.get(pos) != Some(&b'"') {
            return Err(format!("label {key}: expected '\"'"));
        }
        pos += 1;
        let mut chunk_start = pos;
        loop {
            match bytes.get(pos) {
                None => return Err(format!("label {key}: unterminated value")),
                Some(b'"') => {
                    buf.push_str(&line[chunk_start..pos]);
                    buf.push('\0');
                    pos += 1;
                    break;
                }
                // NUL separates the label buffer; no real exposition carries one.
                Some(0) => return Err(format!("label {key}: NUL byte in value")),
                Some(b'\\') => {
                    buf.push_str(&line[chunk_start..pos]);
                    match bytes.get(pos + 1) {
                        Some(b'\\') => buf.push('\\'),
                        Some(b'"') => buf.push('"'),
                        Some(b'n') => buf.push('\n'),
                        _ => return Err(format!("label {key}: bad escape")),
                    }
                    pos += 2;
                    chunk_start = pos;
                }
                Some(_) => pos += 1,
            }
        }
        pos = skip_ws(pos);
        match bytes.get(pos) {
            Some(b',') => pos += 1,
            Some(b'}') => return Ok(pos + 1),
            _ => return Err("expected ',' or '}' after a label value".into()),
        }
    }
}

/// Rust's float parser already reads `NaN`, `+Inf`, `-Inf` (case-insensitive). Most
/// values are small integers (counters, bucket counts): those are read digit by
/// digit, exactly (below 2^53 every integer is an `f64`), which is what the general
/// parser would return.
fn parse_float(text: &str) -> Option<f64> {
    let digits = text.as_bytes();
    if !digits.is_empty() && digits.len() <= 15 && digits.iter().all(u8::is_ascii_digit) {
        let n = digits
            .iter()
            .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        // n < 10^15 < 2^53: the conversion is exact.
        return Some(n as f64);
    }
    text.parse::<f64>().ok()
}

/// The result of scraping one target once.
#[derive(Debug, Clone)]
pub struct ScrapeResult {
    pub target: String,
    /// As it may be shown (redacted).
    pub url: String,
    pub at: DateTime<Utc>,
    pub duration: Duration,
    /// The exposition, or why the target counts as down (connection refused, HTTP
    /// status, timeout, a malformed line).
    pub outcome: Result<Exposition, String>,
}

impl ScrapeResult {
    /// The target answered with a readable exposition.
    pub fn is_up(&self) -> bool {
        self.outcome.is_ok()
    }
}

/// Scrapes a set of targets with one HTTP client (connection reuse, one timeout,
/// one set of [`ScrapeLimits`]).
#[derive(Debug, Clone)]
pub struct Scraper {
    client: reqwest::Client,
    limits: ScrapeLimits,
}

const ACCEPT: &str = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";

/// The start of every error past a cap, as the target's status shows it.
pub const TOO_LARGE: &str = "response too large";

impl Scraper {
    /// A scraper whose every request gives up after `timeout` (a hung target must
    /// show as down, not freeze the dashboard's poll) and past `limits` (a
    /// gigantic one must not take the dashboard's memory).
    pub fn new(timeout: Duration, limits: ScrapeLimits) -> Result<Scraper, reqwest::Error> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("idemwatch/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Scraper { client, limits })
    }

    /// Scrape one target.
    pub async fn scrape(&self, target: &str, url: &str) -> ScrapeResult {
        let at = Utc::now();
        let started = Instant::now();
        let outcome = self.exposition(url).await;
        ScrapeResult {
            target: target.to_string(),
            url: crate::redact::redact_url(url),
            at,
            duration: started.elapsed(),
            outcome,
        }
    }

    /// Scrape all targets concurrently (a slow one does not delay the others).
    pub async fn scrape_all(&self, targets: &[(String, String)]) -> Vec<ScrapeResult> {
        futures::future::join_all(targets.iter().map(|(name, url)| self.scrape(name, url))).await
    }

    /// One `/metrics` page, parsed, or why it could not be read.
    pub async fn exposition(&self, url: &str) -> Result<Exposition, String> {
        let mut response = self
            .client
            .get(url)
            .header(reqwest::header::ACCEPT, ACCEPT)
            .send()
            .await
            .map_err(|e| error_chain(&e))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("HTTP {status}"));
        }
        let max = self.limits.max_body_bytes;
        let body_too_large = || format!("{TOO_LARGE}: more than {max} bytes");
        if response.content_length().is_some_and(|n| n > max) {
            return Err(body_too_large());
        }
        // Parsed as it arrives: an exporter that streams its encoding (idemwatch's
        // does) is encoding the rest while the first lines are parsed here. Nothing
        // but the unfinished last line is kept of what was parsed.
        let mut parser = Parser::with_limits(self.limits);
        let refused = |e: ParseError| match e.too_large {
            true => format!("{TOO_LARGE}: {e}"),
            false => format!("malformed exposition: {e}"),
        };
        let mut received: u64 = 0;
        while let Some(piece) = response.chunk().await.map_err(|e| error_chain(&e))? {
            received = received.saturating_add(piece.len() as u64);
            if received > max {
                return Err(body_too_large());
            }
            parser.feed(&piece).map_err(refused)?;
        }
        parser.finish().map_err(refused)
    }
}

/// reqwest's own message is terse ("error sending request"); the operator needs the
/// cause ("Connection refused"). reqwest quotes the URL, userinfo included: the
/// text comes back redacted.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    crate::redact::redact_text(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_escaped_label_values() {
        let e = parse("m{path=\"C:\\\\x\",msg=\"say \\\"hi\\\"\\n\"} 1\n").unwrap();
        let s = &e.samples[0];
        assert_eq!(s.label("path"), Some("C:\\x"));
        assert_eq!(s.label("msg"), Some("say \"hi\"\n"));
    }

    #[test]
    fn labels_read_the_same_inside_the_sample_and_on_the_heap() {
        // `k NUL v NUL` is 4 bytes plus the value: around the inline limit of 62.
        for len in [0, 1, 57, 58, 59, 60, 200] {
            let value = "v".repeat(len);
            let e = parse(&format!("m{{k=\"{value}\",z=\"\"}} 1\nm 2\n")).unwrap();
            let labels = &e.samples[0].labels;
            assert_eq!(labels.get("k"), Some(value.as_str()), "{len}");
            assert_eq!(labels.get("z"), Some(""));
            assert_eq!(labels.iter().count(), 2);
            assert_eq!(labels.as_key(), format!("k\0{value}\0z\0\0"));
            assert_eq!(labels, &labels.clone());
            assert!(e.samples[1].labels.is_empty());
            assert_ne!(labels, &e.samples[1].labels);
        }
        let e = parse("m{a=\"1,b=2\"} 1\nm{a=\"1\",b=\"2\"} 1\n").unwrap();
        assert_ne!(e.samples[0].labels.as_key(), e.samples[1].labels.as_key());
        assert_eq!(
            format!("{:?}", e.samples[1].labels),
            r#"{"a": "1", "b": "2"}"#
        );
    }

    #[test]
    fn names_are_shared_and_found_by_run() {
        let text = "h_sum{c=\"a\"} 1\nh_count{c=\"a\"} 2\nh_bucket{c=\"a\",le=\"1\"} 3\n\
                    h_bucket{c=\"a\",le=\"+Inf\"} 4\nh_sum{c=\"b\"} 5\nh_sum_x 6\nh_sum 7\n";
        let e = parse(text).unwrap();
        assert!(Arc::ptr_eq(&e.samples[0].name, &e.samples[4].name));
        assert_eq!(e.runs().count(), 7 - 1);
        let by_name = e.by_name();
        for name in ["h_sum", "h_count", "h_bucket", "h_sum_x", "h", "missing"] {
            let scan: Vec<f64> = e
                .samples
                .iter()
                .filter(|s| &*s.name == name)
                .map(|s| s.value)
                .collect();
            let named: Vec<f64> = e.named(name).map(|s| s.value).collect();
            let indexed: Vec<f64> = by_name.named(name).map(|s| s.value).collect();
            assert_eq!((&named, &indexed), (&scan, &scan), "{name}");
            assert_eq!(by_name.first(name), e.first(name));
        }
    }

    #[test]
    fn integers_read_digit_by_digit_equal_the_float_parser() {
        for text in [
            "0",
            "7",
            "007",
            "999999999999999",
            "1000000000000000",
            "9007199254740993",
            "123456789012345678901",
            "-5",
            "+5",
            "1.5",
            "1e3",
        ] {
            assert_eq!(parse_float(text), text.parse::<f64>().ok(), "{text}");
        }
        assert_eq!(parse_float(""), None);
    }

    #[test]
    fn malformed_line_is_refused_with_its_number() {
        let err = parse("ok 1\nbad{a=\"x} 2\n").unwrap_err();
        assert_eq!(err.line, 2);
        assert!(parse("m 1 2 3\n").is_err());
        assert!(parse("m abc\n").is_err());
    }
}
