#!/usr/bin/env bash
# A PostgreSQL outage under `serve`'s default settings (issue 14): does it make dead
# letters, lose or double an effect, and how long does the engine take to catch up?
#
#   scripts/pg-outage.sh [OUTAGE_SECONDS]        default 600 (10 minutes)
#
# What it does, on a PRIVATE database only (created here, dropped at the end):
#   1. creates database idw_outage_<pid>, starts an SMS sandbox and
#      `serve --consumer trip-counter --consumer zone-exit-sms` on it (default
#      runner settings: visibility 30s, max_deliveries 10, claim lease 60s);
#   2. publishes BEFORE zone exits and waits until they are processed;
#   3. makes the database unreachable: ALTER DATABASE … ALLOW_CONNECTIONS false and
#      pg_terminate_backend of that database's sessions (no other database is touched);
#   4. publishes DURING zone exits spread over the outage (through the embedded queue,
#      which does not need PostgreSQL), holds the outage OUTAGE_SECONDS;
#   5. gives the database back and measures how long until every message is processed;
#   6. prints dead letters, effects applied (trip counters, sent claims, SMS the
#      sandbox accepted), duplicates, and the catch-up time.
#
# Environment: IDEMWATCH_BIN (default target/profiling/idemwatch, else target/release, else target/debug),
# IDEMWATCH_PG_URL (admin URL, default postgres://postgres@127.0.0.1:5432/test),
# BEFORE (default 20), DURING (default 40), CATCH_UP_LIMIT seconds (default 600).
# Exit status 0 only when there are 0 dead letters and every effect happened once.
set -euo pipefail

OUTAGE=${1:-600}
BEFORE=${BEFORE:-20}
DURING=${DURING:-40}
CATCH_UP_LIMIT=${CATCH_UP_LIMIT:-600}
ADMIN=${IDEMWATCH_PG_URL:-postgres://postgres@127.0.0.1:5432/test}
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
[[ $OUTAGE =~ ^[0-9]+$ ]] || { echo "usage: $0 [OUTAGE_SECONDS]" >&2; exit 2; }

WORK=$(mktemp -d)
DB=idw_outage_$$_$RANDOM
DB_URL=$(with_database "$ADMIN" "$DB")
QUEUE="sqlite://$WORK/queue.db"
SCRATCH="sqlite://$WORK/scratch.db" # `publish` opens a store; not the one in the outage
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SMS_PORT=$(port)
METRICS_PORT=$(port)
PIDS=()

admin() { psql -qtAX "$ADMIN" -v ON_ERROR_STOP=1 -c "$1"; }
private() { psql -qtAX "$DB_URL" -v ON_ERROR_STOP=1 -c "$1"; }
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  admin "ALTER DATABASE $DB ALLOW_CONNECTIONS true" >/dev/null 2>&1 || true
  admin "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

zone_exits() { # FROM TO -> a .jsonl file of zone exits of devices OUTAGE-FROM..TO-1
  local f="$WORK/in-$1.jsonl"
  for ((i = $1; i < $2; i++)); do
    printf '{"device_id":"OUTAGE-%d","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}\n' "$i"
  done >"$f"
  echo "$f"
}
publish() { "$BIN" publish --db "$SCRATCH" --queue "$QUEUE" --log-file "$WORK/publish.log" \
  --consumer trip-counter --consumer zone-exit-sms "$1" >/dev/null; }
metric() { # NAME CONSUMER -> the counter's value on serve's /metrics (0 when absent)
  curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics" 2>/dev/null |
    awk -v m="$1{consumer=\"$2\"}" '$1 == m { v = $2 } END { print v + 0 }'
}
processed() { echo $(( $(metric idem_messages_processed_total trip-counter) + $(metric idem_messages_processed_total zone-exit-sms) )); }
now() { date +%s; }

admin "CREATE DATABASE $DB" >/dev/null
"$BIN" sms-sandbox --listen "127.0.0.1:$SMS_PORT" --log-file "$WORK/sandbox.log" &
PIDS+=($!)
"$BIN" serve --db "$DB_URL" --queue "$QUEUE" --sms-url "http://127.0.0.1:$SMS_PORT" \
  --listen "127.0.0.1:$METRICS_PORT" --log-file "$WORK/serve.log" \
  --consumer trip-counter --consumer zone-exit-sms &
PIDS+=($!)
TOTAL=$((BEFORE + DURING))

echo "binary $BIN; private database $DB; outage ${OUTAGE}s; $BEFORE zone exits before, $DURING during"
for _ in $(seq 1 120); do curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics" >/dev/null 2>&1 && break; sleep 1; done
publish "$(zone_exits 0 "$BEFORE")"
deadline=$(( $(now) + 300 ))
until [[ $(processed) -ge $((2 * BEFORE)) ]]; do
  [[ $(now) -lt $deadline ]] || { echo "the first $BEFORE were not processed" >&2; exit 1; }
  sleep 1
done

echo "$(date -u +%T) outage starts"
admin "ALTER DATABASE $DB ALLOW_CONNECTIONS false" >/dev/null
admin "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '$DB'" >/dev/null
start=$(now)
# The messages of the outage arrive spread over it: the first at once, the last
# near its end, so some wait the whole outage and some only a little.
for ((k = 0; k < 4; k++)); do
  from=$((BEFORE + k * DURING / 4)); to=$((BEFORE + (k + 1) * DURING / 4))
  publish "$(zone_exits "$from" "$to")"
  left=$(( start + (k + 1) * OUTAGE / 4 - $(now) ))
  [[ $k -lt 3 && $left -gt 0 ]] && sleep "$left"
done
left=$(( start + OUTAGE - $(now) )); [[ $left -gt 0 ]] && sleep "$left"
paused=$(curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics" | grep -c '^idem_consumer_paused{.*} 1' || true)
admin "ALTER DATABASE $DB ALLOW_CONNECTIONS true" >/dev/null
back=$(now)
echo "$(date -u +%T) database back after $((back - start))s (consumers paused at that moment: $paused)"

until [[ $(processed) -ge $((2 * TOTAL)) ]]; do
  [[ $(( $(now) - back )) -lt $CATCH_UP_LIMIT ]] || { echo "not caught up within ${CATCH_UP_LIMIT}s" >&2; break; }
  sleep 1
done
caught=$(( $(now) - back ))

dead=$(private "SELECT count(*) FROM dead_letters")
reasons=$(private "SELECT coalesce(string_agg(reason || '=' || n, ' '), '-') FROM (SELECT reason, count(*) n FROM dead_letters GROUP BY reason) r")
counters=$(private "SELECT count(*) FILTER (WHERE zone_exits = 1) || ' devices at 1, ' || count(*) FILTER (WHERE zone_exits > 1) || ' above 1' FROM trip_counters")
counted=$(private "SELECT coalesce(sum(zone_exits), 0) FROM trip_counters")
sent_claims=$(private "SELECT count(*) FROM side_effect_claims WHERE state = 'sent'")
open_claims=$(private "SELECT count(*) FROM side_effect_claims WHERE state <> 'sent'")
sms=$(curl -fsS "http://127.0.0.1:$SMS_PORT/sms/sent" | python3 -c 'import json,sys; v=json.load(sys.stdin); v=v.get("sent", v) if isinstance(v, dict) else v; print(len(v))')
dups=$(( $(metric idem_duplicate_dropped_total trip-counter) + $(metric idem_duplicate_dropped_total zone-exit-sms) ))
infra=$(curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics" | awk '/^idem_infra_errors_total/ { s += $2 } END { print s + 0 }')

cat <<EOF
outage_seconds        $((back - start))
zone_exits            $TOTAL ($BEFORE before, $DURING during)
dead_letters          $dead ($reasons)
trip_counters         sum $counted of $TOTAL ($counters)
sms_claims_sent       $sent_claims of $TOTAL ($open_claims not sent)
sms_accepted          $sms of $TOTAL (the sandbox's count of distinct SMS)
duplicates_dropped    $dups
infra_errors          $infra
catch_up_seconds      $caught (database back -> every message processed)
EOF
[[ $dead -eq 0 && $counted -eq $TOTAL && $sent_claims -eq $TOTAL && $sms -eq $TOTAL && $open_claims -eq 0 ]]
