//! The exposition parser against the two grammars, case by case: expositions
//! written from the OpenMetrics 1.0 specification (its ABNF, its data model and its
//! examples) and from Prometheus' text format 0.0.4 page, each with the values it
//! must give or the line it must be refused at. Not our exporter's output: that is
//! `monitor_prometheus.rs`'s. And `promtool check metrics` (Prometheus' own text
//! parser) as an oracle on the text cases: it must agree wherever the table does not
//! say why it differs.

use std::io::Write;
use std::process::{Command, Stdio};

use idemwatch_base::exposition::{parse, Exposition, Format, MetricType, Parser};

use Format::{OpenMetrics as Om, PrometheusText as Text};

/// What a case must give.
#[derive(Debug)]
enum Expect {
    /// Every sample, in order: name, labels as `k=v` joined by `|`, value, timestamp.
    Samples(&'static [(&'static str, &'static str, f64, Option<f64>)]),
    /// Refused at this line, the message containing this text.
    Refused(usize, &'static str),
}

/// Where `promtool check metrics` (the Go text parser of `prometheus/common`) reads a
/// text case otherwise, and why we follow the specification (or Prometheus' scrape
/// parser) instead.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Promtool {
    Agrees,
    Differs(&'static str),
}

struct Case {
    what: &'static str,
    format: Format,
    text: &'static str,
    expect: Expect,
    promtool: Promtool,
}

use Expect::{Refused, Samples};
use Promtool::{Agrees, Differs};

const INF: f64 = f64::INFINITY;

fn case(what: &'static str, format: Format, text: &'static str, expect: Expect) -> Case {
    Case {
        what,
        format,
        text,
        expect,
        promtool: Agrees,
    }
}

fn cases() -> Vec<Case> {
    vec![
        // ---- OpenMetrics 1.0: valid ----
        case(
            "the specification's complete exposition",
            Om,
            "# TYPE acme_http_router_request_seconds summary\n\
             # UNIT acme_http_router_request_seconds seconds\n\
             # HELP acme_http_router_request_seconds Latency though all of ACME's HTTP request router.\n\
             acme_http_router_request_seconds_sum{path=\"/api/v1\",method=\"GET\"} 9036.32\n\
             acme_http_router_request_seconds_count{path=\"/api/v1\",method=\"GET\"} 807283.0\n\
             acme_http_router_request_seconds_created{path=\"/api/v1\",method=\"GET\"} 1605281325.0\n\
             # TYPE go_goroutines gauge\n\
             # HELP go_goroutines Number of goroutines that currently exist.\n\
             go_goroutines 69\n\
             # TYPE process_cpu_seconds counter\n\
             # UNIT process_cpu_seconds seconds\n\
             # HELP process_cpu_seconds Total user and system CPU time spent in seconds.\n\
             process_cpu_seconds_total 4.20072246e+06\n\
             # EOF\n",
            Samples(&[
                ("acme_http_router_request_seconds_sum", "path=/api/v1|method=GET", 9036.32, None),
                ("acme_http_router_request_seconds_count", "path=/api/v1|method=GET", 807283.0, None),
                ("acme_http_router_request_seconds_created", "path=/api/v1|method=GET", 1605281325.0, None),
                ("go_goroutines", "", 69.0, None),
                ("process_cpu_seconds_total", "", 4.20072246e6, None),
            ]),
        ),
        case(
            "escapes: \\\", \\n, \\\\ unescaped, any other kept as written",
            Om,
            "bar_seconds_count{a=\"x\",b=\"escaping\\\" example \\n \",c=\"C:\\\\dir\",d=\"\\z\\a\"} 0\n# EOF\n",
            Samples(&[(
                "bar_seconds_count",
                "a=x|b=escaping\" example \n |c=C:\\dir|d=\\z\\a",
                0.0,
                None,
            )]),
        ),
        case(
            "empty label braces, leading zeros, no final newline after # EOF",
            Om,
            "bar_seconds_count{} 0042\n# EOF",
            Samples(&[("bar_seconds_count", "", 42.0, None)]),
        ),
        case(
            "NaN, +Inf, -Inf, Infinity in any case, floats with and without digits around the point",
            Om,
            "# TYPE g gauge\ng{v=\"a\"} NaN\ng{v=\"b\"} +Inf\ng{v=\"c\"} -Inf\ng{v=\"d\"} infinity\n\
             g{v=\"e\"} .5\ng{v=\"f\"} 5.\ng{v=\"g\"} 1.89e-7\ng{v=\"h\"} -1E3\n# EOF\n",
            Samples(&[
                ("g", "v=a", f64::NAN, None),
                ("g", "v=b", INF, None),
                ("g", "v=c", -INF, None),
                ("g", "v=d", INF, None),
                ("g", "v=e", 0.5, None),
                ("g", "v=f", 5.0, None),
                ("g", "v=g", 1.89e-7, None),
                ("g", "v=h", -1000.0, None),
            ]),
        ),
        case(
            "gauge MetricPoints with timestamps in seconds",
            Om,
            "# TYPE foo gauge\nfoo{a=\"b\"} 17.0 1520879607.789\nfoo 17.0 123\nfoo 18.0 456\nfoo 1 -5\n# EOF\n",
            Samples(&[
                ("foo", "a=b", 17.0, Some(1520879607.789)),
                ("foo", "", 17.0, Some(123.0)),
                ("foo", "", 18.0, Some(456.0)),
                ("foo", "", 1.0, Some(-5.0)),
            ]),
        ),
        case(
            "counter with created, a timestamp and an exemplar",
            Om,
            "# TYPE foo counter\n# HELP foo Some text and \\n some \\\" escaping\n\
             foo_total 17.0 1520879607.789 # {trace_id=\"KOO5S4vxi0o\"} 0.67\n\
             foo_created 1520430000.123 1520879607.789\n# EOF\n",
            Samples(&[
                ("foo_total", "", 17.0, Some(1520879607.789)),
                ("foo_created", "", 1520430000.123, Some(1520879607.789)),
            ]),
        ),
        case(
            "an empty HELP and an empty UNIT",
            Om,
            "# TYPE foo_seconds counter\n# UNIT foo_seconds \n# HELP foo_seconds \nfoo_seconds_total 1\n# EOF\n",
            Samples(&[("foo_seconds_total", "", 1.0, None)]),
        ),
        case(
            "stateset",
            Om,
            "# TYPE foo stateset\nfoo{entity=\"controller\",foo=\"a\"} 1.0\nfoo{entity=\"controller\",foo=\"bb\"} 0.0\n# EOF\n",
            Samples(&[
                ("foo", "entity=controller|foo=a", 1.0, None),
                ("foo", "entity=controller|foo=bb", 0.0, None),
            ]),
        ),
        case(
            "info",
            Om,
            "# TYPE foo info\nfoo_info{entity=\"replica\",name=\"prettier name\",version=\"8.1.9\"} 1.0\n# EOF\n",
            Samples(&[(
                "foo_info",
                "entity=replica|name=prettier name|version=8.1.9",
                1.0,
                None,
            )]),
        ),
        case(
            "summary with quantiles, count, sum, created",
            Om,
            "# TYPE foo summary\nfoo{quantile=\"0.95\"} 123.7\nfoo{quantile=\"0.99\"} 150.0\nfoo{quantile=\"0\"} NaN\n\
             foo_count 17.0\nfoo_sum 324789.3\nfoo_created 1520430000.123\n# EOF\n",
            Samples(&[
                ("foo", "quantile=0.95", 123.7, None),
                ("foo", "quantile=0.99", 150.0, None),
                ("foo", "quantile=0", f64::NAN, None),
                ("foo_count", "", 17.0, None),
                ("foo_sum", "", 324789.3, None),
                ("foo_created", "", 1520430000.123, None),
            ]),
        ),
        case(
            "histogram with exemplars (the specification's example)",
            Om,
            "# TYPE foo histogram\nfoo_bucket{le=\"0.01\"} 0\nfoo_bucket{le=\"0.1\"} 8 # {} 0.054\n\
             foo_bucket{le=\"1\"} 11 # {trace_id=\"KOO5S4vxi0o\"} 0.67\n\
             foo_bucket{le=\"10\"} 17 # {trace_id=\"oHg5SJYRHA0\"} 9.8 1520879607.789\n\
             foo_bucket{le=\"+Inf\"} 17\nfoo_count 17\nfoo_sum 324789.3\nfoo_created 1520430000.123\n# EOF\n",
            Samples(&[
                ("foo_bucket", "le=0.01", 0.0, None),
                ("foo_bucket", "le=0.1", 8.0, None),
                ("foo_bucket", "le=1", 11.0, None),
                ("foo_bucket", "le=10", 17.0, None),
                ("foo_bucket", "le=+Inf", 17.0, None),
                ("foo_count", "", 17.0, None),
                ("foo_sum", "", 324789.3, None),
                ("foo_created", "", 1520430000.123, None),
            ]),
        ),
        case(
            "gaugehistogram",
            Om,
            "# TYPE foo gaugehistogram\nfoo_bucket{le=\"0.01\"} 20.0\nfoo_bucket{le=\"+Inf\"} 42.0\n\
             foo_gcount 42.0\nfoo_gsum -3289.3\n# EOF\n",
            Samples(&[
                ("foo_bucket", "le=0.01", 20.0, None),
                ("foo_bucket", "le=+Inf", 42.0, None),
                ("foo_gcount", "", 42.0, None),
                ("foo_gsum", "", -3289.3, None),
            ]),
        ),
        case(
            "unknown, with and without TYPE; a colon in a name; an empty exposition",
            Om,
            "# TYPE foo unknown\nfoo 42.23\nsome:aggregate:rate5m{a_b=\"c\"} 1\n# EOF\n",
            Samples(&[
                ("foo", "", 42.23, None),
                ("some:aggregate:rate5m", "a_b=c", 1.0, None),
            ]),
        ),
        case("only # EOF", Om, "# EOF\n", Samples(&[])),
        // ---- OpenMetrics 1.0: invalid ----
        case("no # EOF", Om, "a 1\nb 2\n", Refused(3, "# EOF")),
        case("an empty body", Om, "", Refused(1, "# EOF")),
        case("a sample after # EOF", Om, "a 1\n# EOF\nb 2\n", Refused(3, "after # EOF")),
        case("a blank line after # EOF", Om, "a 1\n# EOF\n\n", Refused(3, "after # EOF")),
        case("a blank line", Om, "a 1\n\nb 2\n# EOF\n", Refused(2, "blank")),
        case("a comment", Om, "# hello\na 1\n# EOF\n", Refused(1, "not # TYPE")),
        case("a carriage return", Om, "a 1\r\n# EOF\n", Refused(1, "bad value")),
        case(
            "a family's samples not one group",
            Om,
            "a 1\nb 1\na 2\n# EOF\n",
            Refused(3, "metric family a again"),
        ),
        case(
            "a family's metadata again after another family",
            Om,
            "# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\n# HELP a late\n# EOF\n",
            Refused(5, "metric family a again"),
        ),
        case("two TYPE lines", Om, "# TYPE a gauge\n# TYPE a gauge\na 1\n# EOF\n", Refused(2, "second TYPE")),
        case("TYPE after samples", Om, "a 1\n# TYPE a gauge\n# EOF\n", Refused(2, "after its samples")),
        case("two HELP lines", Om, "# HELP a x\n# HELP a y\n# EOF\n", Refused(2, "second HELP")),
        case("two UNIT lines", Om, "# UNIT a_s s\n# UNIT a_s s\n# EOF\n", Refused(2, "second UNIT")),
        case(
            "a gauge clashing with a counter's _total",
            Om,
            "# TYPE foo counter\nfoo_total 1\n# TYPE foo_total gauge\nfoo_total 2\n# EOF\n",
            Refused(3, "clashes with metric family foo"),
        ),
        case(
            "a counter clashing with an earlier gauge's name",
            Om,
            "# TYPE foo_created gauge\nfoo_created 1\n# TYPE foo counter\n# EOF\n",
            Refused(3, "clashes with metric family foo_created"),
        ),
        case(
            "a counter's sample without _total",
            Om,
            "# TYPE foo counter\nfoo 1\n# EOF\n",
            Refused(2, "foo_total"),
        ),
        case("the untyped type", Om, "# TYPE a untyped\na 1\n# EOF\n", Refused(1, "unknown type")),
        case("a TYPE with two types", Om, "# TYPE a gauge counter\n# EOF\n", Refused(1, "unknown type")),
        case("HELP without its space", Om, "# HELP a\n# EOF\n", Refused(1, "HELP")),
        case("a negative counter", Om, "# TYPE c counter\nc_total -1\n# EOF\n", Refused(2, "negative")),
        case("a NaN counter", Om, "# TYPE c counter\nc_total NaN\n# EOF\n", Refused(2, "NaN")),
        case("a NaN histogram sum", Om, "# TYPE h histogram\nh_sum NaN\n# EOF\n", Refused(2, "NaN")),
        case(
            "a negative bucket",
            Om,
            "# TYPE h histogram\nh_bucket{le=\"+Inf\"} -1\n# EOF\n",
            Refused(2, "negative"),
        ),
        case("a fractional count", Om, "# TYPE h histogram\nh_count 1.5\n# EOF\n", Refused(2, "integer")),
        case("a bucket without le", Om, "# TYPE h histogram\nh_bucket 1\n# EOF\n", Refused(2, "without le")),
        case("le NaN", Om, "# TYPE h histogram\nh_bucket{le=\"NaN\"} 1\n# EOF\n", Refused(2, "NaN")),
        case("le not a number", Om, "# TYPE h histogram\nh_bucket{le=\"x\"} 1\n# EOF\n", Refused(2, "not a number")),
        case("a quantile above 1", Om, "# TYPE s summary\ns{quantile=\"1.5\"} 1\n# EOF\n", Refused(2, "outside")),
        case("a quantile sample without quantile", Om, "# TYPE s summary\ns 1\n# EOF\n", Refused(2, "quantile")),
        case("a negative quantile value", Om, "# TYPE s summary\ns{quantile=\"0.5\"} -1\n# EOF\n", Refused(2, "negative")),
        case("a state that is 2", Om, "# TYPE s stateset\ns{s=\"a\"} 2\n# EOF\n", Refused(2, "0 or 1")),
        case("a state without its label", Om, "# TYPE s stateset\ns{x=\"a\"} 1\n# EOF\n", Refused(2, "label s")),
        case("an info that is 2", Om, "# TYPE i info\ni_info 2\n# EOF\n", Refused(2, "is 1")),
        case("a UNIT not ending the name", Om, "# TYPE foo counter\n# UNIT foo seconds\n# EOF\n", Refused(2, "ends its name")),
        case("a UNIT on an info", Om, "# TYPE foo_seconds info\n# UNIT foo_seconds seconds\n# EOF\n", Refused(2, "no UNIT")),
        case(
            "an exemplar on a gauge",
            Om,
            "# TYPE g gauge\ng 1 # {a=\"b\"} 1\n# EOF\n",
            Refused(2, "exemplar goes on"),
        ),
        case(
            "an exemplar without braces",
            Om,
            "# TYPE c counter\nc_total 1 # a=\"b\" 1\n# EOF\n",
            Refused(2, "exemplar"),
        ),
        case(
            "an exemplar without a value",
            Om,
            "# TYPE c counter\nc_total 1 # {a=\"b\"}\n# EOF\n",
            Refused(2, "exemplar"),
        ),
        case(
            "an exemplar with a NaN timestamp",
            Om,
            "# TYPE c counter\nc_total 1 # {a=\"b\"} 1 NaN\n# EOF\n",
            Refused(2, "exemplar"),
        ),
        case(
            "an exemplar's labels past 128 characters",
            Om,
            "# TYPE c counter\nc_total 1 # {trace_id=\"0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890\"} 1\n# EOF\n",
            Refused(2, "128"),
        ),
        case(
            "an exemplar's label named twice",
            Om,
            "# TYPE c counter\nc_total 1 # {a=\"1\",a=\"2\"} 1\n# EOF\n",
            Refused(2, "twice"),
        ),
        case("two spaces before the value", Om, "a  1\n# EOF\n", Refused(1, "bad value")),
        case("a trailing space", Om, "a 1 \n# EOF\n", Refused(1, "timestamp")),
        case("a space inside the labels", Om, "a{b=\"1\", c=\"2\"} 1\n# EOF\n", Refused(1, "label name")),
        case("a trailing comma in the labels", Om, "a{b=\"1\",} 1\n# EOF\n", Refused(1, "label name")),
        case("a timestamp that is NaN", Om, "a 1 NaN\n# EOF\n", Refused(1, "timestamp")),
        case("a signed NaN", Om, "a -NaN\n# EOF\n", Refused(1, "bad value")),
        case("a label named twice", Om, "a{b=\"1\",b=\"2\"} 1\n# EOF\n", Refused(1, "twice")),
        case("a label name with a colon", Om, "a{b:c=\"1\"} 1\n# EOF\n", Refused(1, "'='")),
        case("a label name starting with a digit", Om, "a{1b=\"1\"} 1\n# EOF\n", Refused(1, "label name")),
        case("the label __name__", Om, "a{__name__=\"b\"} 1\n# EOF\n", Refused(1, "__name__")),
        case("labels without a name", Om, "{a=\"b\"} 1\n# EOF\n", Refused(1, "metric name")),
        // ---- Prometheus text 0.0.4: valid ----
        case(
            "the format page's example",
            Text,
            "# HELP http_requests_total The total number of HTTP requests.\n\
             # TYPE http_requests_total counter\n\
             http_requests_total{method=\"post\",code=\"200\"} 1027 1395066363000\n\
             http_requests_total{method=\"post\",code=\"400\"}    3 1395066363000\n\
             \n\
             # Escaping in label values:\n\
             msdos_file_access_time_seconds{path=\"C:\\\\DIR\\\\FILE.TXT\",error=\"Cannot find file:\\n\\\"FILE.TXT\\\"\"} 1.458255915e9\n\
             \n\
             # Minimalistic line:\n\
             metric_without_timestamp_and_labels 12.47\n\
             \n\
             # A weird metric from before the epoch:\n\
             something_weird{problem=\"division by zero\"} +Inf -3982045\n\
             \n\
             # A histogram, which has a pretty complex representation in the text format:\n\
             # HELP http_request_duration_seconds A histogram of the request duration.\n\
             # TYPE http_request_duration_seconds histogram\n\
             http_request_duration_seconds_bucket{le=\"0.05\"} 24054\n\
             http_request_duration_seconds_bucket{le=\"+Inf\"} 144320\n\
             http_request_duration_seconds_sum 53423\n\
             http_request_duration_seconds_count 144320\n\
             \n\
             # Finally a summary, which has a complex representation, too:\n\
             # HELP rpc_duration_seconds A summary of the RPC duration in seconds.\n\
             # TYPE rpc_duration_seconds summary\n\
             rpc_duration_seconds{quantile=\"0.01\"} 3102\n\
             rpc_duration_seconds_sum 1.7560473e+07\n\
             rpc_duration_seconds_count 2693\n",
            Samples(&[
                ("http_requests_total", "method=post|code=200", 1027.0, Some(1395066363000.0)),
                ("http_requests_total", "method=post|code=400", 3.0, Some(1395066363000.0)),
                (
                    "msdos_file_access_time_seconds",
                    "path=C:\\DIR\\FILE.TXT|error=Cannot find file:\n\"FILE.TXT\"",
                    1.458255915e9,
                    None,
                ),
                ("metric_without_timestamp_and_labels", "", 12.47, None),
                ("something_weird", "problem=division by zero", INF, Some(-3982045.0)),
                ("http_request_duration_seconds_bucket", "le=0.05", 24054.0, None),
                ("http_request_duration_seconds_bucket", "le=+Inf", 144320.0, None),
                ("http_request_duration_seconds_sum", "", 53423.0, None),
                ("http_request_duration_seconds_count", "", 144320.0, None),
                ("rpc_duration_seconds", "quantile=0.01", 3102.0, None),
                ("rpc_duration_seconds_sum", "", 1.7560473e7, None),
                ("rpc_duration_seconds_count", "", 2693.0, None),
            ]),
        ),
        Case {
            what: "an unknown escape is kept as written",
            format: Text,
            text: "a{b=\"c\\z\"} 1\n",
            expect: Samples(&[("a", "b=c\\z", 1.0, None)]),
            promtool: Differs(
                "expfmt refuses `\\z`; Prometheus' scrape parser keeps it (its lexer takes any escape)",
            ),
        },
        case(
            "blanks and tabs around tokens, a trailing comma, blank lines",
            Text,
            "\n  a\t{ b = \"1\" , c=\"2\", }\t 1\n\n",
            Samples(&[("a", "b=1|c=2", 1.0, None)]),
        ),
        Case {
            what: "trailing blanks after the value",
            format: Text,
            text: "a 1  \n",
            expect: Samples(&[("a", "", 1.0, None)]),
            promtool: Differs("the format page: \"trailing whitespace is ignored\"; expfmt wants a timestamp"),
        },
        case(
            "# EOF is a comment, what follows is read; a counter may go negative",
            Text,
            "a 1\n# EOF\n# TYPE c counter\nc -1 +5\n",
            Samples(&[("a", "", 1.0, None), ("c", "", -1.0, Some(5.0))]),
        ),
        case(
            "NaN, Inf, le and quantile as any numbers, untyped, TYPE without samples",
            Text,
            "# TYPE u untyped\nu nan\nv Infinity\n# TYPE h histogram\nh_bucket{le=\"NaN\"} 1\nh_bucket 2\n\
             # TYPE s summary\ns{quantile=\"2\"} -1\ns 3\n# TYPE lonely gauge\n",
            Samples(&[
                ("u", "", f64::NAN, None),
                ("v", "", INF, None),
                ("h_bucket", "le=NaN", 1.0, None),
                ("h_bucket", "", 2.0, None),
                ("s", "quantile=2", -1.0, None),
                ("s", "", 3.0, None),
            ]),
        ),
        case("an empty body", Text, "", Samples(&[])),
        // ---- Prometheus text 0.0.4: invalid ----
        case("a timestamp that is not an integer", Text, "a 1 1.5\n", Refused(1, "timestamp")),
        case("an exemplar", Text, "a 1 1 # {a=\"b\"} 1\n", Refused(1, "after the timestamp")),
        case("no final newline", Text, "a 1\nb 2", Refused(2, "newline")),
        case("a carriage return", Text, "a 1\r\n", Refused(1, "bad value")),
        case("two TYPE lines", Text, "# TYPE a gauge\n# TYPE a gauge\na 1\n", Refused(2, "second TYPE")),
        case("TYPE after samples", Text, "a 1\n# TYPE a gauge\n", Refused(2, "after its samples")),
        Case {
            what: "HELP after samples",
            format: Text,
            text: "a 1\n# HELP a late\n",
            expect: Refused(2, "after its samples"),
            promtool: Differs("the format page: a family's HELP and TYPE lines come first; expfmt does not check HELP"),
        },
        Case {
            what: "two HELP lines",
            format: Text,
            text: "# HELP a x\n# HELP a y\n",
            expect: Refused(2, "second HELP"),
            promtool: Agrees,
        },
        Case {
            what: "a family's samples not one group",
            format: Text,
            text: "a 1\nb 1\na 2\n",
            expect: Refused(3, "metric family a again"),
            promtool: Differs("the format page: all lines of a metric are one group; expfmt merges them"),
        },
        case("an OpenMetrics-only type", Text, "# TYPE a info\na 1\n", Refused(1, "unknown type")),
        case("a TYPE with two types", Text, "# TYPE a gauge extra\na 1\n", Refused(1, "TYPE")),
        case("a label named twice", Text, "a{x=\"1\",x=\"2\"} 1\n", Refused(1, "twice")),
        case("the label __name__", Text, "a{__name__=\"x\"} 1\n", Refused(1, "__name__")),
        case("a label name with a colon", Text, "a{b:c=\"1\"} 1\n", Refused(1, "'='")),
        case("le not a number", Text, "# TYPE h histogram\nh_bucket{le=\"x\"} 1\n", Refused(2, "not a number")),
        case("quantile not a number", Text, "# TYPE s summary\ns{quantile=\"x\"} 1\n", Refused(2, "not a number")),
        case("a signed NaN", Text, "a -nan\n", Refused(1, "bad value")),
        case("a hexadecimal value", Text, "a 0x10\n", Refused(1, "bad value")),
        case("labels without a name", Text, "{} 1\n", Refused(1, "metric name")),
        case(
            "a value glued to the name: tokens need a blank only where they would merge",
            Text,
            "a-1\nb{c=\"d\"}2\n",
            Samples(&[("a", "", -1.0, None), ("b", "c=d", 2.0, None)]),
        ),
        case("a value glued to the name", Om, "a-1\n# EOF\n", Refused(1, "one space")),
        case("an unterminated label value", Text, "ok 1\nbad{a=\"x} 2\n", Refused(2, "unterminated")),
        case("no value", Text, "a\n", Refused(1, "missing value")),
    ]
}

fn labels_of(e: &Exposition, i: usize) -> String {
    e.samples[i]
        .labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("|")
}

fn same(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

fn check(case: &Case, got: &Result<Exposition, String>, line: Option<usize>, how: &str) {
    let what = format!("{} ({:?}, {how})", case.what, case.format);
    match (&case.expect, got) {
        (Samples(want), Ok(e)) => {
            assert_eq!(e.samples.len(), want.len(), "{what}: {:?}", e.samples);
            for (i, (name, labels, value, timestamp)) in want.iter().enumerate() {
                let s = &e.samples[i];
                assert_eq!(&*s.name, *name, "{what}: sample {i}");
                assert_eq!(labels_of(e, i), *labels, "{what}: sample {i}");
                assert!(
                    same(s.value, *value),
                    "{what}: sample {i}: {} ≠ {value}",
                    s.value
                );
                match (s.timestamp, timestamp) {
                    (None, None) => {}
                    (Some(a), Some(b)) if same(a, *b) => {}
                    other => panic!("{what}: sample {i}: timestamps {other:?}"),
                }
            }
            assert_eq!(e.format, case.format, "{what}");
        }
        (Refused(want_line, message), Err(e)) => {
            assert_eq!(line, Some(*want_line), "{what}: {e}");
            assert!(
                e.contains(message),
                "{what}: {e:?} does not say {message:?}"
            );
        }
        (want, got) => panic!("{what}: expected {want:?}, got {got:?}"),
    }
}

#[test]
fn every_case_parses_or_is_refused_as_its_grammar_says() {
    for case in cases() {
        let whole = parse(case.text, case.format);
        let line = whole.as_ref().err().map(|e| e.line);
        check(&case, &whole.map_err(|e| e.to_string()), line, "whole");
        // Fed a byte at a time, as a scrape's pieces may come.
        let mut parser = Parser::new(case.format, Default::default());
        let fed = case
            .text
            .as_bytes()
            .chunks(1)
            .try_for_each(|b| parser.feed(b))
            .and_then(|()| parser.finish());
        let line = fed.as_ref().err().map(|e| e.line);
        check(&case, &fed.map_err(|e| e.to_string()), line, "byte by byte");
    }
}

#[test]
fn families_get_their_declared_types() {
    let e = parse(
        "# TYPE a gaugehistogram\na_bucket{le=\"+Inf\"} 1\n# TYPE b stateset\nb{b=\"x\"} 1\n\
         # TYPE c info\nc_info 1\n# TYPE d unknown\nd 1\n# EOF\n",
        Om,
    )
    .unwrap();
    assert_eq!(e.type_of("a_bucket"), Some(MetricType::GaugeHistogram));
    assert_eq!(e.type_of("b"), Some(MetricType::StateSet));
    assert_eq!(e.type_of("c_info"), Some(MetricType::Info));
    assert_eq!(e.type_of("d"), Some(MetricType::Unknown));
    assert!(e.saw_eof);
    let e = parse("# TYPE u untyped\nu 1\n# EOF\n", Text).unwrap();
    assert_eq!(e.type_of("u"), Some(MetricType::Untyped));
    assert!(!e.saw_eof, "a comment in text format");
}

#[test]
fn bytes_that_are_not_utf8_are_refused_on_their_line() {
    for format in [Text, Om] {
        let body = b"a 1\nb{c=\"\xff\"} 2\n# EOF\n";
        let err = parse(&String::from_utf8_lossy(body), format);
        // Through `parse` the bytes are already text (replaced): the scraper's path
        // is `feed`, which sees the raw bytes.
        assert!(err.is_ok(), "{format:?}: {err:?}");
        let mut parser = Parser::new(format, Default::default());
        let err = parser
            .feed(body)
            .and_then(|()| parser.finish())
            .expect_err("invalid UTF-8");
        assert_eq!(err.line, 2, "{format:?}: {err}");
        assert!(err.message.contains("UTF-8"), "{err}");
    }
}

#[test]
fn the_content_type_picks_the_grammar() {
    for (content_type, format) in [
        (
            Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            Om,
        ),
        (Some("Application/OpenMetrics-Text"), Om),
        (Some("text/plain; version=0.0.4; charset=utf-8"), Text),
        (Some("text/plain"), Text),
        (Some("application/json"), Text),
        (None, Text),
    ] {
        assert_eq!(
            Format::from_content_type(content_type),
            format,
            "{content_type:?}"
        );
    }
}

fn required() -> bool {
    std::env::var("IDEMWATCH_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// `promtool check metrics`: `Ok(())` when it parses the text (lint findings, exit
/// code 3, are not parse errors), `Err(line)` when it refuses it; `None` without
/// promtool.
fn promtool(text: &str) -> Option<Result<(), usize>> {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if !required() => {
            eprintln!("SKIP: promtool not available ({e})");
            return None;
        }
        Err(e) => panic!("promtool is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}"),
    };
    let mut stdin = child.stdin.take()?;
    stdin.write_all(text.as_bytes()).expect("write to promtool");
    drop(stdin);
    let out = child.wait_with_output().expect("promtool ran");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match out.status.code() {
        Some(0 | 3) => Some(Ok(())),
        Some(1) => {
            let line = said
                .split("parsing error in line ")
                .nth(1)
                .and_then(|rest| rest.split(':').next())
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("promtool refused without a line: {said}"));
            Some(Err(line))
        }
        other => panic!("promtool exited {other:?}: {said}"),
    }
}

#[test]
fn promtool_reads_the_text_cases_as_we_do() {
    let mut compared = 0;
    for case in cases().into_iter().filter(|c| c.format == Text) {
        let Some(theirs) = promtool(case.text) else {
            return;
        };
        let ours = parse(case.text, Text).map(|_| ()).map_err(|e| e.line);
        match case.promtool {
            Agrees => {
                assert_eq!(ours, theirs, "{}: we and promtool differ", case.what);
                compared += 1;
            }
            Differs(why) => eprintln!("{}: promtool {theirs:?}, we {ours:?} ({why})", case.what),
        }
    }
    assert!(compared >= 20, "only {compared} cases compared");
}
