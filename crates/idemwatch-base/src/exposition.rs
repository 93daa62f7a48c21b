//! Scraping `/metrics` endpoints and parsing the text exposition.
//!
//! # Why our own parser
//!
//! We read two grammars, chosen by the scrape's Content-Type ([`Format`]): the
//! classic Prometheus text format 0.0.4 (`text/plain`, and whatever a target sends
//! without a known type) and OpenMetrics 1.0 (`application/openmetrics-text`), which
//! `prometheus-client` (our own engine) emits. The crates considered:
//!
//! - `prometheus-parse` (and `prometheus-scrape`, which it copies): regex per line over
//!   an iterator of owned `String`s, no notion of `# EOF` or OpenMetrics timestamps
//!   in seconds, few releases in years.
//! - `openmetrics-parser`: a pest grammar, LGPL-3.0 (awkward for a statically
//!   linked MIT binary).
//!
//! The format is line-based and small. A hand parser reads both grammars and, on an
//! engine's exposition, allocates nothing per sample: a name is allocated once per
//! exposition and shared by its samples, a short label set lives inside its sample.
//! 10,000 samples parse in well under a millisecond optimised (see `bench scrape` in
//! BENCHMARKS.md).
//!
//! # What is refused
//!
//! A whole exposition is refused on its first invalid line, with that line's number
//! (a half-read scrape would show wrong rates; OpenMetrics: "partial or invalid
//! expositions MUST be considered erroneous in their entirety").
//!
//! In both formats:
//! - a line that is not a sample, a metadata line or (text only) a comment; a metric
//!   name outside `[a-zA-Z_:][a-zA-Z0-9_:]*`, a label name outside
//!   `[a-zA-Z_][a-zA-Z0-9_]*`, the label name `__name__`, a label named twice in one
//!   sample, an unterminated label value, a value that is not a number (`NaN`,
//!   `+Inf`, `-Inf`, `Infinity` in any case are numbers; a signed `NaN` is not),
//!   anything after the timestamp, bytes that are not UTF-8;
//! - a metric family whose lines are not one group (a sample or metadata line of a
//!   family after another family began), two families that could give the same
//!   sample name (a counter `foo` and a gauge `foo_total` in OpenMetrics, a
//!   histogram `foo` and a family `foo_count`), a second `TYPE` or `HELP` (or
//!   `UNIT`) for a family, metadata after the family's samples, an unknown type;
//! - a histogram bucket whose `le`, or a summary sample whose `quantile`, is not a
//!   number.
//!
//! Prometheus text 0.0.4 only: the last line must end with a newline; the timestamp
//! is an integer (milliseconds); whitespace between tokens, blank lines and `#`
//! comments are free (`# EOF` is a comment there, lines after it are read); an
//! exemplar is not text format. An unknown escape in a label value (`\z`) is kept as
//! written, as Prometheus keeps it (`promtool check metrics` refuses it).
//!
//! OpenMetrics 1.0 only (its ABNF and data model): `# EOF` must end the exposition,
//! nothing after it (an optional final newline aside); single spaces, no blank line,
//! no comment other than `# TYPE`, `# HELP`, `# UNIT`; no trailing comma in labels;
//! timestamps are numbers of seconds (not `NaN` or infinite); sample names follow
//! their family's type (a counter's are `_total` and `_created`, an info's
//! `_info`…); a `_total`, `_bucket`, `_count`, `_gcount`, `_sum` that is negative or
//! `NaN` (a `_gsum` that is `NaN`), a fractional `_bucket`, `_count` or `_gcount`; a
//! bucket without `le` or with `le="NaN"`, a quantile sample without a `quantile`
//! in [0, 1] or with a negative value; a stateset sample that is not 0 or 1 or lacks
//! the label named after its family, an info sample that is not 1; a `UNIT` that is
//! not the suffix of its family's name, or is on an info or stateset; an exemplar
//! that is malformed, longer than 128 characters of label names and values, or on
//! anything but a counter's `_total` or a histogram's `_bucket`. An unknown escape is
//! valid and kept as written.
//!
//! Not checked (read as given): the HELP text, a bucket series' order and
//! cumulativeness, a series given twice, timestamps going backwards. A NUL in a label
//! value (valid OpenMetrics) is refused: NUL separates [`Labels`]' buffer.

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

/// The grammar of a body: its Content-Type says which (the rules differ: `# EOF`,
/// timestamps in seconds or milliseconds, exemplars, sample names per type).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// `text/plain; version=0.0.4`, and what a target sends without a known type
    /// (Prometheus falls back to it too).
    #[default]
    PrometheusText,
    /// `application/openmetrics-text; version=1.0.0`.
    OpenMetrics,
}

impl Format {
    /// The format a response's Content-Type announces.
    pub fn from_content_type(content_type: Option<&str>) -> Format {
        let media = content_type
            .and_then(|v| v.split(';').next())
            .map(str::trim)
            .unwrap_or_default();
        if media.eq_ignore_ascii_case("application/openmetrics-text") {
            Format::OpenMetrics
        } else {
            Format::PrometheusText
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
    /// Prometheus text's type for a family without (or with an `untyped`) `TYPE`.
    Untyped,
    /// OpenMetrics' type for a family without `TYPE`.
    Unknown,
    GaugeHistogram,
    StateSet,
    Info,
}

/// What a sample is within its family: the suffix its name adds to the family's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// No suffix: a gauge's, an untyped's, a summary's quantile, a stateset's state.
    Value,
    Total,
    Created,
    Bucket,
    Sum,
    Count,
    GaugeSum,
    GaugeCount,
    Info,
}

impl MetricType {
    /// A `# TYPE` line's type, if the format has it.
    fn parse(kind: &str, format: Format) -> Option<MetricType> {
        let shared = match kind {
            "counter" => Some(MetricType::Counter),
            "gauge" => Some(MetricType::Gauge),
            "histogram" => Some(MetricType::Histogram),
            "summary" => Some(MetricType::Summary),
            _ => None,
        };
        shared.or(match (format, kind) {
            (Format::PrometheusText, "untyped") => Some(MetricType::Untyped),
            (Format::OpenMetrics, "unknown") => Some(MetricType::Unknown),
            (Format::OpenMetrics, "gaugehistogram") => Some(MetricType::GaugeHistogram),
            (Format::OpenMetrics, "stateset") => Some(MetricType::StateSet),
            (Format::OpenMetrics, "info") => Some(MetricType::Info),
            _ => None,
        })
    }

    /// The type of a family no `TYPE` line names.
    fn undeclared(format: Format) -> MetricType {
        match format {
            Format::PrometheusText => MetricType::Untyped,
            Format::OpenMetrics => MetricType::Unknown,
        }
    }

    /// The sample names of a family of this type: the family's name plus one of
    /// these suffixes (text 0.0.4 has no `_total` rule and no `_created`).
    fn suffixes(self, format: Format) -> &'static [(&'static str, Role)] {
        use Role::*;
        match (format, self) {
            (Format::OpenMetrics, MetricType::Counter) => {
                &[("_total", Total), ("_created", Created)]
            }
            (Format::OpenMetrics, MetricType::Summary) => &[
                ("", Value),
                ("_sum", Sum),
                ("_count", Count),
                ("_created", Created),
            ],
            (Format::OpenMetrics, MetricType::Histogram) => &[
                ("_bucket", Bucket),
                ("_sum", Sum),
                ("_count", Count),
                ("_created", Created),
            ],
            (_, MetricType::GaugeHistogram) => &[
                ("_bucket", Bucket),
                ("_gsum", GaugeSum),
                ("_gcount", GaugeCount),
            ],
            (_, MetricType::Info) => &[("_info", Info)],
            (Format::PrometheusText, MetricType::Summary) => {
                &[("", Value), ("_sum", Sum), ("_count", Count)]
            }
            (Format::PrometheusText, MetricType::Histogram) => {
                &[("_bucket", Bucket), ("_sum", Sum), ("_count", Count)]
            }
            _ => &[("", Value)],
        }
    }
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
    /// The OpenMetrics terminator was read (always, in an OpenMetrics exposition
    /// that parsed; never in Prometheus text, where `# EOF` is a comment).
    pub saw_eof: bool,
    /// The grammar it was read with.
    pub format: Format,
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
        [
            "_total", "_created", "_bucket", "_sum", "_count", "_gsum", "_gcount", "_info",
        ]
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

/// One metric family as its lines arrive: what its metadata said, and whether its
/// samples began (its metadata must come first).
struct Family {
    name: Arc<str>,
    kind: MetricType,
    /// Its first line, for the message when it comes back.
    line: usize,
    typed: bool,
    helped: bool,
    unit: Option<Box<str>>,
    sampled: bool,
}

/// What one parse reuses from line to line: the names seen so far (one `Arc` each),
/// the buffer labels are unescaped into, and the families (each one group of
/// lines, no two giving the same sample name).
#[derive(Default)]
struct ParseState {
    format: Format,
    names: HashSet<Arc<str>>,
    current: Option<Arc<str>>,
    labels: String,
    exemplar_labels: String,
    family: Option<Family>,
    /// Every sample name an ended family could give → that family and its first
    /// line: a name met again belongs to a family that is over.
    claimed: HashMap<Box<str>, (Arc<str>, usize)>,
    /// The previous sample's name and its role in `family` (names are shared:
    /// compared by pointer, so a family's run of samples costs no lookup).
    last: Option<(Arc<str>, Role)>,
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
        let name = self.intern(&line[start..end]);
        self.current = Some(name.clone());
        (name, end)
    }

    fn intern(&mut self, text: &str) -> Arc<str> {
        match self.names.get(text) {
            Some(name) => name.clone(),
            None => {
                let name: Arc<str> = Arc::from(text);
                self.names.insert(name.clone());
                name
            }
        }
    }

    /// The current family is over: the sample names it could give are taken.
    fn end_family(&mut self) {
        self.last = None;
        if let Some(f) = self.family.take() {
            for (suffix, _) in f.kind.suffixes(self.format) {
                self.claimed
                    .entry(format!("{}{suffix}", f.name).into())
                    .or_insert_with(|| (f.name.clone(), f.line));
            }
            self.claimed
                .entry(f.name.as_ref().into())
                .or_insert_with(|| (f.name.clone(), f.line));
        }
    }

    /// Whether an ended family could give `name`.
    fn clash(&self, name: &str) -> Result<(), String> {
        match self.claimed.get(name) {
            None => Ok(()),
            Some((family, first)) if **family == *name => Err(format!(
                "metric family {name} again: its lines began at line {first} and must be one group"
            )),
            Some((family, first)) => Err(format!(
                "{name} clashes with metric family {family} (line {first})"
            )),
        }
    }

    /// A family begins at `line` (a metadata line or a sample of another name).
    fn begin_family(&mut self, name: Arc<str>, line: usize) -> Result<&mut Family, String> {
        self.end_family();
        self.clash(&name)?;
        Ok(self.family.insert(Family {
            name,
            kind: MetricType::undeclared(self.format),
            line,
            typed: false,
            helped: false,
            unit: None,
            sampled: false,
        }))
    }

    /// The family a metadata line names, which must not have had samples yet.
    fn metadata_family(
        &mut self,
        name: &str,
        line: usize,
        what: &str,
    ) -> Result<&mut Family, String> {
        if !is_metric_name(name) {
            return Err(format!("{what}: {name:?} is not a metric name"));
        }
        self.last = None;
        let family = match self.family.take() {
            Some(f) if *f.name == *name => self.family.insert(f),
            other => {
                self.family = other;
                let name = self.intern(name);
                self.begin_family(name, line)?
            }
        };
        if family.sampled {
            return Err(format!("{what} for {name} after its samples"));
        }
        Ok(family)
    }

    /// `# TYPE name kind`.
    fn declare_type(&mut self, name: &str, kind: &str, line: usize) -> Result<MetricType, String> {
        let format = self.format;
        let Some(kind) = MetricType::parse(kind, format) else {
            return Err(format!("TYPE {name}: unknown type {kind:?}"));
        };
        let family = self.metadata_family(name, line, "TYPE")?;
        if family.typed {
            return Err(format!("a second TYPE for {name}"));
        }
        family.typed = true;
        family.kind = kind;
        let unit_ok =
            family.unit.is_none() || !matches!(kind, MetricType::Info | MetricType::StateSet);
        for (suffix, _) in kind.suffixes(format) {
            let sample = format!("{name}{suffix}");
            if let Some((family, first)) = self.claimed.get(sample.as_str()) {
                return Err(format!(
                    "{name} ({kind:?}) clashes with metric family {family} (line {first}): both give {sample}"
                ));
            }
        }
        if !unit_ok {
            return Err(format!("{name}: an {kind:?} family has no UNIT"));
        }
        Ok(kind)
    }

    /// The role of a sample named `name` in the current family, or in a new one of
    /// that name (without `TYPE`).
    fn role_of(&mut self, name: &Arc<str>, line: usize) -> Result<(Role, MetricType), String> {
        if let (Some((last, role)), Some(f)) = (&self.last, &self.family) {
            if Arc::ptr_eq(last, name) {
                return Ok((*role, f.kind));
            }
        }
        let format = self.format;
        let found = self.family.as_ref().and_then(|f| {
            let rest = name.strip_prefix(&*f.name)?;
            let suffixes = f.kind.suffixes(format);
            suffixes.iter().find(|(s, _)| *s == rest).map(|(_, r)| *r)
        });
        let family = match found {
            Some(_) => self.family.as_mut(),
            None => {
                if let Some(f) = self.family.as_ref().filter(|f| *f.name == **name) {
                    let names: Vec<String> = f
                        .kind
                        .suffixes(format)
                        .iter()
                        .map(|(s, _)| format!("{name}{s}"))
                        .collect();
                    return Err(format!(
                        "{name}: the samples of a {:?} family are named {}",
                        f.kind,
                        names.join(", ")
                    ));
                }
                Some(self.begin_family(name.clone(), line)?)
            }
        };
        let role = found.unwrap_or(Role::Value);
        let kind = family.map_or(MetricType::undeclared(format), |f| {
            f.sampled = true;
            f.kind
        });
        self.last = Some((name.clone(), role));
        Ok((role, kind))
    }
}

/// Parse a Prometheus or OpenMetrics text exposition (with the default
/// [`ScrapeLimits`] on lines and samples).
pub fn parse(text: &str, format: Format) -> Result<Exposition, ParseError> {
    let mut parser = Parser::new(format, ScrapeLimits::default());
    // Already text: the complete lines need no UTF-8 check (`feed` does one).
    match memchr::memrchr(b'\n', text.as_bytes()) {
        Some(end) => {
            parser.lines(&text[..end])?;
            parser
                .pending
                .extend_from_slice(&text.as_bytes()[end + 1..]);
            parser.check_pending()?;
        }
        None => parser.pending.extend_from_slice(text.as_bytes()),
    }
    parser.finish()
}

/// A parse fed with a body's pieces as they arrive ([`Parser::feed`]), so that the
/// lines already received are parsed while the exporter is still encoding the
/// rest. Gives the same exposition, and the same error at the same line, as
/// [`parse`] of the whole body.
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
    /// A parser of `format` that refuses lines and sample counts past `limits`
    /// (the body cap is the reader's: see [`Scraper`]).
    pub fn new(format: Format, limits: ScrapeLimits) -> Parser {
        Parser {
            out: Exposition {
                format,
                ..Exposition::default()
            },
            state: ParseState {
                format,
                ..ParseState::default()
            },
            line: 0,
            pending: Vec::new(),
            limits,
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
    /// complete lines are checked on their own.
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
            if self.state.format == Format::PrometheusText {
                return Err(ParseError::malformed(
                    self.line,
                    "the last line does not end with a newline".into(),
                ));
            }
        }
        if self.state.format == Format::OpenMetrics && !self.out.saw_eof {
            return Err(ParseError::malformed(
                self.line + 1,
                "no # EOF at the end (an OpenMetrics exposition ends with it)".into(),
            ));
        }
        Ok(self.out)
    }

    /// Lines whose ends arrived, without the last newline. Bytes that are not UTF-8
    /// are refused on their line (after the lines before it are read).
    fn complete_lines(&mut self, bytes: &[u8]) -> Result<(), ParseError> {
        match std::str::from_utf8(bytes) {
            Ok(text) => self.lines(text),
            Err(e) => {
                let valid = &bytes[..e.valid_up_to()];
                if let Some(end) = memchr::memrchr(b'\n', valid) {
                    // Cut at a newline inside the valid part: UTF-8 still.
                    self.lines(std::str::from_utf8(&valid[..end]).unwrap_or_default())?;
                }
                Err(ParseError::malformed(
                    self.line + 1,
                    "bytes that are not UTF-8".into(),
                ))
            }
        }
    }

    /// Parse each line of `text` (split on `\n`, the last one included whatever it
    /// ends with).
    fn lines(&mut self, text: &str) -> Result<(), ParseError> {
        for line in split_lines(text) {
            self.line += 1;
            if line.len() > self.limits.max_line_bytes {
                return Err(self.too_large(
                    self.line,
                    format!("a line longer than {} bytes", self.limits.max_line_bytes),
                ));
            }
            let read = match self.state.format {
                _ if self.out.saw_eof => Err("a line after # EOF".into()),
                Format::PrometheusText => self.text_line(line),
                Format::OpenMetrics => self.openmetrics_line(line),
            };
            read.map_err(|message| ParseError::malformed(self.line, message))?;
            if self.out.samples.len() > self.limits.max_samples {
                return Err(self.too_large(
                    self.line,
                    format!("more than {} samples", self.limits.max_samples),
                ));
            }
        }
        Ok(())
    }

    /// A Prometheus text 0.0.4 line: blank, a comment (`# HELP`, `# TYPE` or free
    /// text), or a sample; blanks and tabs around tokens are free.
    fn text_line(&mut self, line: &str) -> Result<(), String> {
        let start = skip_blanks(line.as_bytes(), 0);
        let Some(&first) = line.as_bytes().get(start) else {
            return Ok(());
        };
        if first != b'#' {
            return self.sample(line, start);
        }
        let mut tokens = line[start + 1..]
            .split([' ', '\t'])
            .filter(|t| !t.is_empty());
        match tokens.next() {
            Some("TYPE") => {
                let (Some(name), Some(kind), None) = (tokens.next(), tokens.next(), tokens.next())
                else {
                    return Err("TYPE wants a metric name and a type".into());
                };
                let kind = self.state.declare_type(name, kind, self.line)?;
                self.out.types.insert(name.to_string(), kind);
            }
            Some("HELP") => {
                let Some(name) = tokens.next() else {
                    return Err("HELP without a metric name".into());
                };
                let family = self.state.metadata_family(name, self.line, "HELP")?;
                if std::mem::replace(&mut family.helped, true) {
                    return Err(format!("a second HELP for {name}"));
                }
            }
            // A free comment (`# EOF` is one in this format).
            _ => {}
        }
        Ok(())
    }

    /// An OpenMetrics 1.0 line: a sample, `# TYPE|HELP|UNIT name …` or `# EOF`,
    /// single spaces, nothing else.
    fn openmetrics_line(&mut self, line: &str) -> Result<(), String> {
        if !line.starts_with('#') {
            if line.is_empty() {
                return Err("a blank line (OpenMetrics has none)".into());
            }
            return self.sample(line, 0);
        }
        if line == "# EOF" {
            self.out.saw_eof = true;
            self.state.end_family();
            return Ok(());
        }
        let not_metadata =
            || "a line starting with # that is not # TYPE, # HELP, # UNIT or # EOF".to_string();
        let rest = line.strip_prefix("# ").ok_or_else(not_metadata)?;
        let (keyword, rest) = rest.split_once(' ').ok_or_else(not_metadata)?;
        match keyword {
            "TYPE" => {
                let (name, kind) = rest
                    .split_once(' ')
                    .ok_or("TYPE wants a metric name and a type")?;
                let kind = self.state.declare_type(name, kind, self.line)?;
                self.out.types.insert(name.to_string(), kind);
            }
            "HELP" => {
                let (name, _) = rest
                    .split_once(' ')
                    .ok_or("HELP wants a metric name, a space and a text (maybe empty)")?;
                let family = self.state.metadata_family(name, self.line, "HELP")?;
                if std::mem::replace(&mut family.helped, true) {
                    return Err(format!("a second HELP for {name}"));
                }
            }
            "UNIT" => {
                let (name, unit) = rest
                    .split_once(' ')
                    .ok_or("UNIT wants a metric name, a space and a unit (maybe empty)")?;
                if !unit.bytes().all(is_name_char) {
                    return Err(format!("UNIT {name}: {unit:?} is not a unit"));
                }
                let family = self.state.metadata_family(name, self.line, "UNIT")?;
                if family.unit.is_some() {
                    return Err(format!("a second UNIT for {name}"));
                }
                if !unit.is_empty() {
                    if name
                        .strip_suffix(unit)
                        .and_then(|n| n.strip_suffix('_'))
                        .is_none()
                    {
                        return Err(format!(
                            "UNIT {unit}: a family's unit ends its name ({name} does not end with _{unit})"
                        ));
                    }
                    if matches!(family.kind, MetricType::Info | MetricType::StateSet) {
                        return Err(format!("{name}: an {:?} family has no UNIT", family.kind));
                    }
                }
                family.unit = Some(unit.into());
            }
            _ => return Err(not_metadata()),
        }
        Ok(())
    }

    /// A sample line from `start` (its name): `name[{labels}] value [timestamp]`,
    /// and in OpenMetrics an exemplar ` # {labels} value [timestamp]`.
    fn sample(&mut self, line: &str, start: usize) -> Result<(), String> {
        let format = self.state.format;
        let strict = format == Format::OpenMetrics;
        let bytes = line.as_bytes();
        if !is_name_start(bytes[start]) {
            return Err("expected a metric name".into());
        }
        let (name, mut pos) = self.state.name_at(line, start);
        let (role, kind) = self.state.role_of(&name, self.line)?;
        if !strict {
            pos = skip_blanks(bytes, pos);
        }
        let mut labels = Labels::default();
        if bytes.get(pos) == Some(&b'{') {
            let buf = &mut self.state.labels;
            buf.clear();
            pos = parse_labels(line, pos + 1, buf, strict).map_err(|e| format!("{name}: {e}"))?;
            labels = Labels::from_buf(buf);
        }
        let rest = &line[pos..];
        let (value, timestamp, exemplar) = match format {
            Format::PrometheusText => {
                let mut fields = rest.split([' ', '\t']).filter(|t| !t.is_empty());
                let value = fields
                    .next()
                    .ok_or_else(|| format!("{name}: missing value"))?;
                let timestamp = fields.next();
                if let Some(extra) = fields.next() {
                    return Err(format!("{name}: unexpected {extra:?} after the timestamp"));
                }
                (value, timestamp, None)
            }
            Format::OpenMetrics => {
                let rest = rest
                    .strip_prefix(' ')
                    .ok_or_else(|| format!("{name}: expected one space before the value"))?;
                let (value, after) = match rest.split_once(' ') {
                    Some((value, after)) => (value, Some(after)),
                    None => (rest, None),
                };
                // ` # {…} v [t]` or ` t` or ` t # {…} v [t]`.
                let (timestamp, exemplar) = match after {
                    None => (None, None),
                    Some(after) => match after.strip_prefix("# ") {
                        Some(exemplar) => (None, Some(exemplar)),
                        None => match after.split_once(' ') {
                            None => (Some(after), None),
                            Some((timestamp, more)) => match more.strip_prefix("# ") {
                                Some(exemplar) => (Some(timestamp), Some(exemplar)),
                                None => {
                                    return Err(format!(
                                        "{name}: unexpected {more:?} after the timestamp"
                                    ))
                                }
                            },
                        },
                    },
                };
                (value, timestamp, exemplar)
            }
        };
        let value = parse_float(value).ok_or_else(|| format!("{name}: bad value {value:?}"))?;
        let timestamp = match timestamp {
            None => None,
            Some(t) => Some(parse_timestamp(t, format).ok_or_else(|| {
                format!(
                    "{name}: bad timestamp {t:?} ({})",
                    match format {
                        Format::PrometheusText => "integer milliseconds",
                        Format::OpenMetrics => "seconds",
                    }
                )
            })?),
        };
        check_sample(format, kind, role, &name, &labels, value)?;
        if let Some(exemplar) = exemplar {
            let allowed = matches!(
                (kind, role),
                (MetricType::Counter, Role::Total)
                    | (
                        MetricType::Histogram | MetricType::GaugeHistogram,
                        Role::Bucket
                    )
            );
            if !allowed {
                return Err(format!(
                    "{name}: an exemplar goes on a counter's _total or a histogram's _bucket"
                ));
            }
            parse_exemplar(exemplar, &mut self.state.exemplar_labels)
                .map_err(|e| format!("{name}: exemplar: {e}"))?;
        }
        self.out.samples.push(Sample {
            name,
            labels,
            value,
            timestamp,
        });
        Ok(())
    }
}

/// The rules a sample's value and labels follow for its family's type: `le` and
/// `quantile` are numbers in both formats; OpenMetrics' data model adds the rest.
fn check_sample(
    format: Format,
    kind: MetricType,
    role: Role,
    name: &str,
    labels: &Labels,
    value: f64,
) -> Result<(), String> {
    let om = format == Format::OpenMetrics;
    match (kind, role) {
        (MetricType::Histogram | MetricType::GaugeHistogram, Role::Bucket) => {
            // Nearly every bucket's `le` is a plain decimal: checked without the
            // float parser (a histogram is most of an engine's samples).
            match labels.get("le").map(|le| {
                (
                    le,
                    plain_decimal(le).then_some(0.0).or_else(|| parse_float(le)),
                )
            }) {
                None if om => return Err(format!("{name}: a bucket without le")),
                Some((le, None)) => return Err(format!("{name}: le {le:?} is not a number")),
                Some((_, Some(le))) if om && le.is_nan() => {
                    return Err(format!("{name}: le is NaN"))
                }
                _ => {}
            }
        }
        (MetricType::Summary, Role::Value) => {
            match labels.get("quantile").map(|q| (q, parse_float(q))) {
                None if om => return Err(format!("{name}: a quantile without quantile")),
                Some((q, None)) => return Err(format!("{name}: quantile {q:?} is not a number")),
                Some((q, Some(n))) if om && !(0.0..=1.0).contains(&n) => {
                    return Err(format!("{name}: quantile {q} is outside [0, 1]"))
                }
                _ if om && value < 0.0 => {
                    return Err(format!("{name}: a quantile's value is negative ({value})"))
                }
                _ => {}
            }
        }
        (MetricType::StateSet, _) if om => {
            if value != 0.0 && value != 1.0 {
                return Err(format!("{name}: a state is 0 or 1, not {value}"));
            }
            if labels.get(name).is_none() {
                return Err(format!("{name}: a state without the label {name}"));
            }
        }
        (MetricType::Info, _) if om && value != 1.0 => {
            return Err(format!("{name}: an info sample is 1, not {value}"));
        }
        _ => {}
    }
    if om {
        let counts = matches!(
            role,
            Role::Total | Role::Bucket | Role::Count | Role::GaugeCount | Role::Sum
        );
        if (counts || role == Role::GaugeSum) && value.is_nan() {
            return Err(format!("{name}: NaN where a count is expected"));
        }
        if counts && value < 0.0 {
            return Err(format!("{name}: a count is negative ({value})"));
        }
        if matches!(role, Role::Bucket | Role::Count | Role::GaugeCount) && value.fract() != 0.0 {
            return Err(format!("{name}: a count is not an integer ({value})"));
        }
    }
    Ok(())
}

/// An OpenMetrics exemplar after its ` # `: `{labels} value [timestamp]`, read to
/// check it and dropped (ingestors may discard exemplars; we chart none).
fn parse_exemplar(text: &str, buf: &mut String) -> Result<(), String> {
    let rest = text.strip_prefix('{').ok_or("expected '{'")?;
    buf.clear();
    let end = parse_labels(rest, 0, buf, true)?;
    let chars = buf.chars().filter(|&c| c != '\0').count();
    if chars > 128 {
        return Err(format!(
            "{chars} characters of label names and values (at most 128)"
        ));
    }
    let rest = rest[end..]
        .strip_prefix(' ')
        .ok_or("expected a space and a value")?;
    let (value, timestamp) = match rest.split_once(' ') {
        Some((value, timestamp)) => (value, Some(timestamp)),
        None => (rest, None),
    };
    parse_float(value).ok_or_else(|| format!("bad value {value:?}"))?;
    if let Some(t) = timestamp {
        parse_timestamp(t, Format::OpenMetrics).ok_or_else(|| format!("bad timestamp {t:?}"))?;
    }
    Ok(())
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

/// A metric name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
fn is_metric_name(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.first().is_some_and(|&b| is_name_start(b)) && bytes.iter().all(|&b| is_name_char(b))
}

/// A label name character: `[a-zA-Z0-9_]` (a metric name's, without the colon).
fn is_label_char(b: u8) -> bool {
    b != b':' && is_name_char(b)
}

/// The end of the name starting at `pos`.
fn name_end(bytes: &[u8], mut pos: usize) -> usize {
    while pos < bytes.len() && is_name_char(bytes[pos]) {
        pos += 1;
    }
    pos
}

/// The first position at or after `pos` that is not a blank or a tab.
fn skip_blanks(bytes: &[u8], mut pos: usize) -> usize {
    while pos < bytes.len() && (bytes[pos] == b' ' || bytes[pos] == b'\t') {
        pos += 1;
    }
    pos
}

/// Whether the label buffer (`key NUL value NUL …`) already has `key`.
fn has_label(buf: &str, key: &str) -> bool {
    let mut parts = buf.split('\0');
    while let (Some(k), Some(_)) = (parts.next(), parts.next()) {
        if k == key {
            return true;
        }
    }
    false
}

/// Parse `name="value",…}` starting after `{` into `buf` (`key NUL value NUL …`,
/// unescaped); returns the position after `}`. `strict` is OpenMetrics': no blank
/// around tokens, no trailing comma.
fn parse_labels(
    line: &str,
    mut pos: usize,
    buf: &mut String,
    strict: bool,
) -> Result<usize, String> {
    let bytes = line.as_bytes();
    let skip = |p: usize| if strict { p } else { skip_blanks(bytes, p) };
    let mut after_comma = false;
    loop {
        pos = skip(pos);
        match bytes.get(pos) {
            Some(b'}') if !(strict && after_comma) => return Ok(pos + 1),
            Some(&b) if is_label_char(b) && !b.is_ascii_digit() => {}
            _ => {
                return Err(format!(
                    "expected a label name{} at column {}",
                    if strict && after_comma { "" } else { " or '}'" },
                    pos + 1
                ))
            }
        }
        let start = pos;
        while pos < bytes.len() && is_label_char(bytes[pos]) {
            pos += 1;
        }
        let key = &line[start..pos];
        if key == "__name__" {
            return Err("the label name __name__ is reserved for the metric name".into());
        }
        if !buf.is_empty() && has_label(buf, key) {
            return Err(format!("label {key} given twice"));
        }
        buf.push_str(key);
        buf.push('\0');
        pos = skip(pos);
        if bytes.get(pos) != Some(&b'=') {
            return Err(format!("label {key}: expected '='"));
        }
        pos = skip(pos + 1);
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
                // NUL separates the label buffer.
                Some(0) => return Err(format!("label {key}: NUL byte in value")),
                Some(b'\\') => {
                    let unescaped = match bytes.get(pos + 1) {
                        Some(b'\\') => '\\',
                        Some(b'"') => '"',
                        Some(b'n') => '\n',
                        None => return Err(format!("label {key}: unterminated value")),
                        // Any other escape is kept as written (both grammars
                        // allow it; Prometheus keeps it).
                        Some(_) => {
                            pos += 1;
                            continue;
                        }
                    };
                    buf.push_str(&line[chunk_start..pos]);
                    buf.push(unescaped);
                    pos += 2;
                    chunk_start = pos;
                }
                Some(_) => pos += 1,
            }
        }
        pos = skip(pos);
        match bytes.get(pos) {
            Some(b',') => {
                pos += 1;
                after_comma = true;
            }
            Some(b'}') => return Ok(pos + 1),
            _ => return Err("expected ',' or '}' after a label value".into()),
        }
    }
}

/// `[+-]?digits[.digits][(e|E)[+-]?digits]` or `[+-]?.digits…`: a finite number
/// in both grammars, recognised without converting it.
fn plain_decimal(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let digits = |i: &mut usize| {
        let start = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - start
    };
    let mut mantissa = digits(&mut i);
    if b.get(i) == Some(&b'.') {
        i += 1;
        mantissa += digits(&mut i);
    }
    if mantissa == 0 {
        return false;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

/// A timestamp: integer milliseconds in Prometheus text, seconds (a number, not
/// `NaN` or infinite) in OpenMetrics.
fn parse_timestamp(text: &str, format: Format) -> Option<f64> {
    match format {
        Format::PrometheusText => text.parse::<i64>().ok().map(|ms| ms as f64),
        Format::OpenMetrics => parse_float(text).filter(|t| t.is_finite()),
    }
}

/// Rust's float parser already reads `NaN`, `+Inf`, `-Inf`, `Infinity`
/// (case-insensitive), `.5`, `5.` and `1E3`, as both grammars do. Most
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
    // Rust also reads a signed NaN, which neither grammar has.
    if matches!(digits.first(), Some(b'+' | b'-')) && text[1..].eq_ignore_ascii_case("nan") {
        return None;
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
        let format = Format::from_content_type(
            response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
        );
        let mut parser = Parser::new(format, self.limits);
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
pub fn error_chain(e: &dyn std::error::Error) -> String {
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
        let e = parse(
            "m{path=\"C:\\\\x\",msg=\"say \\\"hi\\\"\\n\"} 1\n",
            Format::PrometheusText,
        )
        .unwrap();
        let s = &e.samples[0];
        assert_eq!(s.label("path"), Some("C:\\x"));
        assert_eq!(s.label("msg"), Some("say \"hi\"\n"));
    }

    #[test]
    fn labels_read_the_same_inside_the_sample_and_on_the_heap() {
        // `k NUL v NUL` is 4 bytes plus the value: around the inline limit of 62.
        for len in [0, 1, 57, 58, 59, 60, 200] {
            let value = "v".repeat(len);
            let e = parse(
                &format!("m{{k=\"{value}\",z=\"\"}} 1\nm 2\n"),
                Format::PrometheusText,
            )
            .unwrap();
            let labels = &e.samples[0].labels;
            assert_eq!(labels.get("k"), Some(value.as_str()), "{len}");
            assert_eq!(labels.get("z"), Some(""));
            assert_eq!(labels.iter().count(), 2);
            assert_eq!(labels.as_key(), format!("k\0{value}\0z\0\0"));
            assert_eq!(labels, &labels.clone());
            assert!(e.samples[1].labels.is_empty());
            assert_ne!(labels, &e.samples[1].labels);
        }
        let e = parse(
            "m{a=\"1,b=2\"} 1\nm{a=\"1\",b=\"2\"} 1\n",
            Format::PrometheusText,
        )
        .unwrap();
        assert_ne!(e.samples[0].labels.as_key(), e.samples[1].labels.as_key());
        assert_eq!(
            format!("{:?}", e.samples[1].labels),
            r#"{"a": "1", "b": "2"}"#
        );
    }

    #[test]
    fn names_are_shared_and_found_by_run() {
        let text = "# TYPE h histogram\nh_sum{c=\"a\"} 1\nh_count{c=\"a\"} 2\nh_bucket{c=\"a\",le=\"1\"} 3\n\
                    h_bucket{c=\"a\",le=\"+Inf\"} 4\nh_sum{c=\"b\"} 5\nh_sum_x 6\nh_sum_y 7\n";
        let e = parse(text, Format::PrometheusText).unwrap();
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
    fn plain_decimals_are_the_finite_numbers_the_float_parser_reads() {
        for text in [
            "0", "1", "+1", "-1", "0.0001", "1e-05", "1e+06", "2.5E3", ".5", "5.", "-.5e1", "+Inf",
            "NaN", "", ".", "e5", "1e", "1e+", "1.2.3", "0x10", "1_0", " 1", "--1",
        ] {
            let finite = parse_float(text).is_some_and(f64::is_finite);
            assert_eq!(plain_decimal(text), finite, "{text:?}");
        }
    }

    #[test]
    fn malformed_line_is_refused_with_its_number() {
        let err = parse("ok 1\nbad{a=\"x} 2\n", Format::PrometheusText).unwrap_err();
        assert_eq!(err.line, 2);
        assert!(parse("m 1 2 3\n", Format::PrometheusText).is_err());
        assert!(parse("m abc\n", Format::PrometheusText).is_err());
    }
}
