#!/usr/bin/env bash
# Issue 16's RabbitMQ + PostgreSQL target, measured the way BENCHMARKS.md reports it:
# RUNS runs of `bench engine --queue amqp://… --batch 100 --runs 5`, each on a fresh
# PostgreSQL database (a database that already holds a run's rows is slower to
# insert into, which would drift the raw side), and the median of the runs' ratios.
# One run's five pairs spread over 0.5–1.0 on a 2-core machine; the median of ten
# or more runs is what moves by less than the target's margin.
#
#   scripts/amqp-pg-bench.sh [RUNS]          default 10
#
# Environment: IDEMWATCH_BIN (default target/profiling/idemwatch, else target/release, else target/debug),
# IDEMWATCH_PG_URL (admin URL, default postgres://postgres@127.0.0.1:5432/test),
# IDEMWATCH_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f), MESSAGES
# (default 20000). Every database it creates is dropped; its queues are removed by
# the bench itself. Prints one line per run and the median; the JSON of each run
# is kept in a temporary directory it names.
set -euo pipefail

RUNS=${1:-10}
MESSAGES=${MESSAGES:-20000}
ADMIN=${IDEMWATCH_PG_URL:-postgres://postgres@127.0.0.1:5432/test}
AMQP=${IDEMWATCH_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
[[ $RUNS =~ ^[0-9]+$ && $RUNS -gt 0 ]] || { echo "usage: $0 [RUNS]" >&2; exit 2; }

export PGOPTIONS=--client-min-messages=warning # no NOTICE for a database not there to drop
WORK=$(mktemp -d)
DB=""
cleanup() { [[ -n $DB ]] && psql "$ADMIN" -q -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "fdatasync of this disk: $(python3 - "$WORK" <<'EOF'
import os, statistics, sys, time
fd = os.open(os.path.join(sys.argv[1], "fsync.probe"), os.O_WRONLY | os.O_CREAT)
t = []
for _ in range(300):
    os.write(fd, b"x" * 4096)
    s = time.perf_counter(); os.fdatasync(fd); t.append((time.perf_counter() - s) * 1e6)
print("%.0f us median" % statistics.median(t))
EOF
)"
for i in $(seq 1 "$RUNS"); do
  DB=idw_amqp_bench_$$_$i
  psql "$ADMIN" -q -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" >/dev/null
  "$BIN" --log-file "$WORK/idemwatch.log" bench engine --db "$(with_database "$ADMIN" "$DB")" --queue "$AMQP" \
    --messages "$MESSAGES" --batch 100 --runs 5 --json >"$WORK/run_$i.json"
  python3 - "$WORK/run_$i.json" "$i" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
raw = [r["raw_messages_per_second"] for r in d["runs"]]
print("run %s: engine/raw %.3f  engine/raw-with-the-queue %.3f  raw %d-%d msg/s  pairs %s" % (
    sys.argv[2], d["ratio"], d["ratio_with_queue"] or 0, min(raw), max(raw),
    " ".join("%.3f" % r["ratio"] for r in d["runs"])))
EOF
  psql "$ADMIN" -q -c "DROP DATABASE $DB" >/dev/null
  DB=""
done
python3 - "$WORK" "$RUNS" <<'EOF'
import json, statistics, sys
ratios = sorted(json.load(open("%s/run_%d.json" % (sys.argv[1], i)))["ratio"] for i in range(1, int(sys.argv[2]) + 1))
print("median of %d runs: %.3f (%d of them >= 0.7); JSON in %s" % (
    len(ratios), statistics.median(ratios), sum(r >= 0.7 for r in ratios), sys.argv[1]))
EOF
