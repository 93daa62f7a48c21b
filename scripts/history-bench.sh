#!/usr/bin/env bash
# History from a Prometheus server that holds DAYS days of 1 s scrapes of four
# consumers (issue 15): how long the dashboard's history fetch takes for that window,
# and the memory of `snapshot` and of the dashboard with it loaded.
#
#   scripts/history-bench.sh [DAYS]          default 7 (a week); 1 for a day
#
# What it does (everything in a scratch directory, deleted at the end unless KEEP=1):
#   1. writes DAYS days of OpenMetrics text, one sample per second per series, as one
#      `serve` with four consumers would have been scraped: processed, duplicates,
#      redelivered, dead letters by reason, process_start_time_seconds, `up`. Steady
#      traffic at a 0.01 % duplicate ratio, a deploy every day at 04:12 UTC (a restart:
#      counters back to 0, a new start time, 0.4 % duplicates and redeliveries for
#      five minutes), a few key_conflict dead letters. ~290 MB of text per day.
#   2. backfills it into a TSDB with `promtool tsdb create-blocks-from openmetrics`
#      (one block per day), starts `prometheus` on it (loopback, private port);
#   3. runs `idemwatch snapshot --json --history <DAYS>d --prometheus URL` three
#      times: the fetch time the snapshot reports (`history_source.fetch_ms`), the
#      series and points it got, the restarts it found, its wall time and peak RSS;
#   4. starts the dashboard in tmux (160×45) with `chart_window = <DAYS>d`, waits
#      until Sources says the history is up, reads its peak RSS (VmHWM) and the fetch
#      time it shows, and keeps the pane as text.
#
# Needs: python3, prometheus and promtool (Debian's `prometheus`), tmux, and a built
# idemwatch (IDEMWATCH_BIN, default target/profiling/idemwatch, else target/release, else target/debug).
# A week is ~2 GB of text and ~2.5 GB of scratch space while it runs.
set -euo pipefail

DAYS=${1:-7}
[[ $DAYS =~ ^[1-9][0-9]?$ ]] || { echo "usage: $0 [DAYS]  (1..99)" >&2; exit 2; }
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
for tool in python3 prometheus promtool tmux; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 2; }
done

WORK=$(mktemp -d)
SOCKET=idw-history-bench-$$
PROM_PID=
cleanup() {
  tmux -L "$SOCKET" kill-server 2>/dev/null || true
  [[ -n $PROM_PID ]] && kill "$PROM_PID" 2>/dev/null && wait "$PROM_PID" 2>/dev/null || true
  if [[ ${KEEP:-0} == 1 ]]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# The instance the series carry: a configured target's host:port, so the dashboard
# matches them to it. Nothing listens there; the target is simply down live.
SERVE_PORT=$(port)
PROM_PORT=$(port)
NOW=$(date +%s)
END=$((NOW - NOW % 60))
START=$((END - DAYS * 86400))

echo "1. generating $DAYS day(s) of 1 s scrapes ($START .. $END)" >&2
T0=$(date +%s.%N)
python3 - "$START" "$END" "127.0.0.1:$SERVE_PORT" > "$WORK/history.om" <<'PY'
import sys
start, end, instance = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = sys.stdout
base = f'job="fleet",instance="{instance}"'
consumers = {"trip-counter": 40, "vehicle-state": 40, "zone-exit-sms": 4, "erp-webhook": 2}
DEPLOY = 4 * 3600 + 12 * 60          # 04:12 UTC every day
SPIKE = 300                          # five minutes of deploy-day duplicates
def starts():
    """Process start times: the first sample, then every deploy."""
    s, t = [start], start - start % 86400 + DEPLOY
    while t <= end:
        if t > start:
            s.append(t)
        t += 86400
    return s
restarts = starts()
def incarnation(t):
    i = 0
    while i + 1 < len(restarts) and restarts[i + 1] <= t:
        i += 1
    return restarts[i]
def series(name, labels, value_of):
    lab = f'{base},{labels}' if labels else base
    w = out.write
    for t in range(start, end + 1):
        w(f'{name}{{{lab}}} {value_of(t)} {t}\n')
def counter(rate, ratio_normal, ratio_deploy):
    """A counter since the process started: `rate`/s, a fraction of it duplicates."""
    def value(t):
        born = incarnation(t)
        age = t - born
        if ratio_normal is None:
            return int(rate * age)
        spike = min(age, SPIKE) if born != start else 0
        return int(rate * (ratio_normal * (age - spike) + ratio_deploy * spike))
    return value
for family, kind in [("idem_messages_processed", "plain"), ("idem_duplicate_dropped", "dup"),
                     ("idem_messages_redelivered", "redelivered")]:
    out.write(f'# TYPE {family} counter\n')
    for c, rate in consumers.items():
        if kind == "plain":
            v = counter(rate, None, None)
        elif kind == "dup":
            v = counter(rate, 0.0001, 0.004)
        else:
            v = counter(rate, 0.0001, 0.006)
        series(f'{family}_total', f'consumer="{c}"', v)
out.write('# TYPE idem_dead_lettered counter\n')
for c in consumers:
    for reason in ["key_conflict", "invalid_envelope", "max_deliveries"]:
        # one key_conflict an hour after each deploy, nothing else
        def v(t, reason=reason):
            if reason != "key_conflict":
                return 0
            return 1 if t - incarnation(t) >= 3600 and incarnation(t) != start else 0
        series('idem_dead_lettered_total', f'consumer="{c}",reason="{reason}"', v)
out.write('# TYPE process_start_time_seconds gauge\n')
series('process_start_time_seconds', '', incarnation)
out.write('# TYPE up gauge\n')
series('up', '', lambda t: 1)
out.write('# EOF\n')
PY
T1=$(date +%s.%N)
TEXT_BYTES=$(stat -c %s "$WORK/history.om")
echo "   $((TEXT_BYTES / 1048576)) MiB of text in $(python3 -c "print(round($T1-$T0,1))") s" >&2

echo "2. backfilling with promtool" >&2
mkdir -p "$WORK/tsdb"
T0=$(date +%s.%N)
promtool tsdb create-blocks-from openmetrics --max-block-duration=24h "$WORK/history.om" "$WORK/tsdb" > "$WORK/promtool.log" 2>&1 \
  || { tail -20 "$WORK/promtool.log" >&2; exit 1; }
T1=$(date +%s.%N)
rm -f "$WORK/history.om"
echo "   $(du -sm "$WORK/tsdb" | cut -f1) MiB of blocks in $(python3 -c "print(round($T1-$T0,1))") s" >&2
cat > "$WORK/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
scrape_configs: []
EOF
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --storage.tsdb.retention.time=30d --web.listen-address="127.0.0.1:$PROM_PORT" \
  > "$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
PROM=http://127.0.0.1:$PROM_PORT
for _ in $(seq 1 120); do
  curl -fsS "$PROM/-/ready" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "$PROM/-/ready" >/dev/null || { tail "$WORK/prometheus.log" >&2; exit 1; }
SAMPLES=$(curl -fsS "$PROM/api/v1/query" --data-urlencode "query=count_over_time(up[${DAYS}d])" --data-urlencode "time=$END" \
  | python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)')
echo "   prometheus on $PROM: $SAMPLES samples of \`up\` in the window (one per second)" >&2

cat > "$WORK/idemwatch.toml" <<EOF
chart_window = "${DAYS}d"
[[targets]]
name = "fleet"
url = "http://127.0.0.1:$SERVE_PORT/metrics"
[prometheus]
url = "$PROM"
EOF
export HOME=$WORK XDG_DATA_HOME=$WORK/data XDG_STATE_HOME=$WORK/state

echo "3. snapshot --json --history ${DAYS}d (3 runs)" >&2
printf 'run\tfetch_ms\twall_s\tmax_rss_kib\tseries\tpoints\tstep_s\tprometheus_restarts\n'
for run in 1 2 3; do
  T0=$(date +%s.%N)
  /usr/bin/time -f '%M' -o "$WORK/rss" "$BIN" snapshot --config "$WORK/idemwatch.toml" --json --history "${DAYS}d" > "$WORK/snapshot.json"
  T1=$(date +%s.%N)
  python3 - "$WORK/snapshot.json" "$run" "$(python3 -c "print(round($T1-$T0,2))")" "$(cat "$WORK/rss")" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
h, src = doc["history"], doc["history_source"]
if src.get("status") != "up":
    sys.exit(f"history not fetched: {src}")
points = sum(len(c["points"]) for c in h["consumers"])
restarts = [m for m in doc["markers"] if m.get("source") == "prometheus"]
print(f'{sys.argv[2]}\t{src["fetch_ms"]}\t{sys.argv[3]}\t{sys.argv[4]}\t{len(h["consumers"])}\t{points}\t{h["step_seconds"]}\t{len(restarts)}')
PY
done

echo "4. the dashboard in tmux with chart_window = ${DAYS}d" >&2
tmux -L "$SOCKET" -f /dev/null new-session -d -x 160 -y 45 \
  "env HOME=$WORK XDG_DATA_HOME=$WORK/data XDG_STATE_HOME=$WORK/state $BIN --config $WORK/idemwatch.toml"
SEEN=
for _ in $(seq 1 120); do
  tmux -L "$SOCKET" capture-pane -p > "$WORK/pane.txt"
  if grep -q 'prometheus history up:' "$WORK/pane.txt"; then SEEN=1; break; fi
  sleep 1
done
[[ -n $SEEN ]] || { cat "$WORK/pane.txt" >&2; echo "the dashboard never showed the history" >&2; exit 1; }
DASH_PID=$(pgrep -n -f "$BIN --config $WORK/idemwatch.toml")
sleep 3
tmux -L "$SOCKET" send-keys 2
sleep 2
tmux -L "$SOCKET" capture-pane -p > "$WORK/pane-duplicates.txt"
HWM=$(awk '/VmHWM/ {print $2}' "/proc/$DASH_PID/status")
RSS=$(awk '/VmRSS/ {print $2}' "/proc/$DASH_PID/status")
echo "dashboard_vmhwm_kib	$HWM"
echo "dashboard_vmrss_kib	$RSS"
grep -A1 'prometheus history' "$WORK/pane.txt" | sed 's/^/dashboard_sources	/'
echo "--- Duplicates tab (160x45) ---" >&2
cat "$WORK/pane-duplicates.txt" >&2
