#!/usr/bin/env bash
# A gray fault between `serve` (DEFAULT settings: no deadline flags) and one of its
# peers, for docs/FAULTS.md (issue 39): the way freezes, black-holes or resets for
# FAULT_SECONDS while zone exits are published; then everything is counted.
#
#   scripts/faults.sh FAULT PEER [FAULT_SECONDS]
#     FAULT: freeze | black-hole | reset      PEER: postgres | mariadb | rabbitmq | nats | redis
#     FAULT_SECONDS: default 60
#
# The fault is made by the tests' own TCP fault proxy (`cargo run --example
# fault_proxy`, tests/common/proxy.rs) in front of the shared server; nothing of the
# server is touched. Everything else is private: a database (PostgreSQL/MariaDB) or
# SQLite file created here and dropped at the end, a queue prefix of its own, an SMS
# sandbox. `serve --consumer trip-counter` (and `zone-exit-sms` on a database peer;
# on Redis `--mode seen-set --seen-set redis://…`) goes through the proxy; the
# producer publishes 10 zone exits every half second straight to the queue.
#
# Prints what it measured, then one Markdown row for docs/FAULTS.md:
#   | peer | fault | lasted | stalled (from the fault's start) | back after the heal | published | lost | duplicated | dead letters | provider repeat calls | timeouts |
# "stalled": until the first message processed after the fault began (a consumer
# that found its way on a fresh connection while the fault still held has a stall
# shorter than the fault). "lost": published, no effect; "duplicated": an effect
# twice (a counter above 1, or two SMS sent for one zone exit); "provider repeat
# calls": SMS requests beyond the first for one Idempotency-Key (the provider
# answered them from its record: nothing sent twice).
#
# Environment: IDEMWATCH_BIN (default target/release/idemwatch, else debug),
# FAULT_PROXY (default target/{release,debug}/examples/fault_proxy),
# IDEMWATCH_PG_URL, IDEMWATCH_MYSQL_URL, IDEMWATCH_AMQP_URL, IDEMWATCH_NATS_URL,
# IDEMWATCH_REDIS_URL (the shared servers; defaults: the local ones),
# CATCH_UP_LIMIT seconds (default 300), CAPTURE (a file: the dashboard runs in tmux
# and its screen is captured the first time it says WAITING and the first time it
# says PAUSED), KEEP_LOGS (a directory: serve's, the sandbox's and the producer's logs
# are copied there at the end).
# Exit status 0 only when nothing was lost, doubled or dead-lettered.
set -euo pipefail

FAULT=${1:-}
PEER=${2:-}
SECONDS_OF_FAULT=${3:-60}
CATCH_UP_LIMIT=${CATCH_UP_LIMIT:-300}
[[ $FAULT =~ ^(freeze|black-hole|reset)$ && $PEER =~ ^(postgres|mariadb|rabbitmq|nats|redis)$ &&
  $SECONDS_OF_FAULT =~ ^[0-9]+$ ]] ||
  { echo "usage: $0 freeze|black-hole|reset postgres|mariadb|rabbitmq|nats|redis [FAULT_SECONDS]" >&2; exit 2; }
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
PROXY_BIN=${FAULT_PROXY:-}
if [[ -z $PROXY_BIN ]]; then
  for b in "$ROOT/target/release/examples/fault_proxy" "$ROOT/target/debug/examples/fault_proxy"; do
    [[ -x $b ]] && PROXY_BIN=$b && break
  done
fi
[[ -x ${PROXY_BIN:-} ]] || { echo "build the proxy first (cargo build --example fault_proxy)" >&2; exit 2; }

PG=${IDEMWATCH_PG_URL:-postgres://postgres@127.0.0.1:5432/test}
MY=${IDEMWATCH_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
AMQP=${IDEMWATCH_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
NATS=${IDEMWATCH_NATS_URL:-nats://127.0.0.1:4222}
REDIS=${IDEMWATCH_REDIS_URL:-redis://127.0.0.1:6379}

WORK=$(mktemp -d)
TAG=$$_$RANDOM
NAME=idw_fault_$TAG
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SMS_PORT=$(port)
METRICS_PORT=$(port)
PROXY_PORT=$(port)
PIDS=()
now() { date +%s.%N; }
elapsed() { python3 -c "print(f'{$1 - $2:.1f}')"; }
hostport() { python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(f"{p.hostname}:{p.port or sys.argv[2]}")' "$1" "$2"; }
through() { python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); n=p.netloc.rsplit("@",1); h=f"127.0.0.1:{sys.argv[2]}"; print(u.urlunsplit(p._replace(netloc=(n[0]+"@"+h) if len(n)==2 else h)))' "$1" "$2"; }

cleanup() {
  exec 7>&- 2>/dev/null || true
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [[ -n ${TMUX_SESSION:-} ]] && tmux kill-session -t "$TMUX_SESSION" 2>/dev/null
  case $PEER in
    postgres) psql -qtAX "$PG" -c "DROP DATABASE IF EXISTS $NAME WITH (FORCE)" >/dev/null 2>&1 || true ;;
    mariadb) mysql -h127.0.0.1 -uroot -e "DROP DATABASE IF EXISTS $NAME" >/dev/null 2>&1 || true ;;
    redis) # this run's seen-set keys (devices FAULT-$TAG-…) only; never a flush
      redis-cli -u "$REDIS" --scan --pattern "idemwatch:seen:*:FAULT-$TAG-*" 2>/dev/null |
        xargs -r -n 500 redis-cli -u "$REDIS" del >/dev/null 2>&1 || true ;;
    rabbitmq)
      for q in $(rabbitmqctl list_queues -q name 2>/dev/null | grep "^$NAME" || true); do
        rabbitmqctl delete_queue "$q" >/dev/null 2>&1 || true
      done
      # rabbitmqctl has no exchange deletion of its own: the broker's function.
      for x in $(rabbitmqctl list_exchanges -q name 2>/dev/null | grep "^$NAME" || true); do
        rabbitmqctl eval "rabbit_exchange:delete(rabbit_misc:r(<<\"/\">>, exchange, <<\"$x\">>), false, <<\"cli\">>)." >/dev/null 2>&1 || true
      done ;;
  esac
  if [[ -n ${KEEP_LOGS:-} ]]; then
    mkdir -p "$KEEP_LOGS" && cp "$WORK"/*.log "$KEEP_LOGS"/ 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# Where serve's database, queue and seen-set are, through the proxy where the fault is.
DB_URL="sqlite://$WORK/store.db"
QUEUE="sqlite://$WORK/queue.db"
PUBLISH_QUEUE=$QUEUE
CONSUMERS=(--consumer trip-counter)
EXTRA=()
case $PEER in
  postgres)
    psql -qtAX "$PG" -v ON_ERROR_STOP=1 -c "CREATE DATABASE $NAME" >/dev/null
    DIRECT=$(with_database "$PG" "$NAME")
    UPSTREAM=$(hostport "$PG" 5432)
    DB_URL=$(through "$DIRECT" "$PROXY_PORT")
    CONSUMERS+=(--consumer zone-exit-sms) ;;
  mariadb)
    mysql -h127.0.0.1 -uroot -e "CREATE DATABASE $NAME"
    DIRECT=$(with_database "$MY" "$NAME")
    UPSTREAM=$(hostport "$MY" 3306)
    DB_URL=$(through "$DIRECT" "$PROXY_PORT")
    CONSUMERS+=(--consumer zone-exit-sms) ;;
  rabbitmq)
    UPSTREAM=$(hostport "$AMQP" 5672)
    QUEUE="$(through "$AMQP" "$PROXY_PORT")?prefix=$NAME"
    PUBLISH_QUEUE="$AMQP?prefix=$NAME" ;;
  nats)
    UPSTREAM=$(hostport "$NATS" 4222)
    QUEUE="$(through "$NATS" "$PROXY_PORT")?prefix=$NAME"
    PUBLISH_QUEUE="$NATS?prefix=$NAME" ;;
  redis)
    UPSTREAM=$(hostport "$REDIS" 6379)
    EXTRA=(--mode seen-set --seen-set "$(through "$REDIS" "$PROXY_PORT")") ;;
esac

mkfifo "$WORK/proxy.in"
"$PROXY_BIN" "$PROXY_PORT" "$UPSTREAM" <"$WORK/proxy.in" >"$WORK/proxy.out" 2>&1 &
PIDS+=($!)
exec 7>"$WORK/proxy.in"
inject() { echo "$1" >&7; }
"$BIN" sms-sandbox --listen "127.0.0.1:$SMS_PORT" --log-file "$WORK/sandbox.log" &
PIDS+=($!)
for _ in $(seq 1 50); do grep -q listening "$WORK/proxy.out" 2>/dev/null && break; sleep 0.1; done
"$BIN" serve --db "$DB_URL" --queue "$QUEUE" --sms-url "http://127.0.0.1:$SMS_PORT" \
  --listen "127.0.0.1:$METRICS_PORT" --log-file "$WORK/serve.log" "${CONSUMERS[@]}" "${EXTRA[@]}" &
PIDS+=($!)

metrics() { curl -fsS --max-time 2 "http://127.0.0.1:$METRICS_PORT/metrics" 2>/dev/null || true; }
metric() { metrics | awk -v m="$1{consumer=\"$2\"}" '$1 == m { v = $2 } END { print v + 0 }'; }
processed() { metric idem_messages_processed_total trip-counter; }
# The fewest any consumer processed: caught up once every consumer has all of them.
least_processed() {
  local least="" c v
  for c in "${CONSUMERS[@]}"; do
    [[ $c == --consumer ]] && continue
    v=$(metric idem_messages_processed_total "$c")
    [[ -z $least || $v -lt $least ]] && least=$v
  done
  echo "${least:-0}"
}

# The producer: 10 zone exits of the next devices every half second, until told to
# stop; how many it published so far is in $WORK/published.
publisher() {
  local n=0 f="$WORK/in.jsonl"
  while [[ ! -e $WORK/stop-publishing ]]; do
    for ((i = n; i < n + 10; i++)); do
      printf '{"device_id":"FAULT-%s-%d","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}\n' "$TAG" "$i"
    done >"$f"
    "$BIN" publish --db "sqlite://$WORK/scratch.db" --queue "$PUBLISH_QUEUE" --log-file "$WORK/publish.log" \
      "${CONSUMERS[@]}" "$f" >/dev/null
    n=$((n + 10))
    echo "$n" >"$WORK/published.new" && mv "$WORK/published.new" "$WORK/published"
    sleep 0.5
  done
}
published() { cat "$WORK/published" 2>/dev/null || echo 0; }

for _ in $(seq 1 120); do [[ -n $(metrics) ]] && break; sleep 1; done
[[ -n $(metrics) ]] || { echo "serve did not start: $(tail -5 "$WORK/serve.log")" >&2; exit 1; }

if [[ -n ${CAPTURE:-} ]]; then
  TMUX_SESSION=idw_fault_$TAG
  DASH_DB=${DIRECT:-$DB_URL}
  cat >"$WORK/dash.toml" <<EOF
poll_interval = "250ms"
[[targets]]
name = "serve"
url = "http://127.0.0.1:$METRICS_PORT/metrics"
[database]
url = "$DASH_DB"
EOF
  tmux new-session -d -s "$TMUX_SESSION" -x 160 -y 45 \
    "IDEMWATCH_LOG_FILE=$WORK/dash.log $BIN --config $WORK/dash.toml"
fi

echo "$(date -u +%T) $PEER $FAULT for ${SECONDS_OF_FAULT}s; serve with default settings; binary $BIN"
publisher &
PIDS+=($!)
until [[ $(processed) -ge 20 ]]; do sleep 0.5; done
before=$(processed)
start=$(now)
inject "$FAULT"
echo "$(date -u +%T) fault injected at $before processed"
resumed=""
captured=""
[[ -n ${CAPTURE:-} ]] && : >"$CAPTURE"
paused_seen=""
end=$(python3 -c "print($start + $SECONDS_OF_FAULT)")
while :; do
  t=$(now)
  p=$(processed)
  m=$(metrics)
  if [[ -z $paused_seen ]] && grep -q '^idem_consumer_paused{.*} 1' <<<"$m"; then
    paused_seen=$(grep '^idem_consumer_paused{.*} 1' <<<"$m" | head -1)
    echo "$(date -u +%T) paused: $paused_seen (after $(elapsed "$t" "$start")s)"
  fi
  if [[ -n ${CAPTURE:-} ]]; then
    # The first screen that says WAITING (a batch held, no deadline fired yet) and
    # the first that says PAUSED (a deadline fired), each once.
    screen=$(tmux capture-pane -p -t "$TMUX_SESSION" 2>/dev/null || true)
    for word in WAITING PAUSED; do
      if [[ $captured != *$word* ]] && grep -q "$word" <<<"$screen"; then
        { echo "# $(date -u +%T), ${PEER} ${FAULT}, $(elapsed "$t" "$start")s into the fault: $word"; echo "$screen"; } >>"$CAPTURE"
        captured="$captured $word"
      fi
    done
  fi
  if [[ -z $resumed ]] && python3 -c "import sys; sys.exit(0 if $t - $start > 1 else 1)" &&
    [[ $p -gt $before ]]; then
    resumed=$t
    echo "$(date -u +%T) processing again $(elapsed "$t" "$start")s after the fault began"
  fi
  python3 -c "import sys; sys.exit(0 if $t < $end else 1)" || break
  [[ -z $resumed ]] && before=$p
  sleep 0.25
done
inject pass
healed=$(now)
echo "$(date -u +%T) healed after $(elapsed "$healed" "$start")s"
sleep 5
touch "$WORK/stop-publishing"
while [[ -e $WORK/published ]] && kill -0 "${PIDS[-1]}" 2>/dev/null; do sleep 0.2; done
PUBLISHED=$(published)
until [[ $(least_processed) -ge $PUBLISHED ]]; do
  [[ -n $resumed ]] || { [[ $(processed) -gt $before ]] && resumed=$(now); }
  python3 -c "import sys; sys.exit(0 if $(now) - $healed < $CATCH_UP_LIMIT else 1)" ||
    { echo "not caught up within ${CATCH_UP_LIMIT}s" >&2; break; }
  sleep 0.5
done
[[ -n $resumed ]] || resumed=$(now)
sleep 2
after_heal=$(python3 -c "print(f'{max(0.0, $resumed - $healed):.1f}')")

count_sql="SELECT count(*) FROM trip_counters WHERE device_id LIKE 'FAULT-$TAG-%'"
dup_sql="SELECT count(*) FROM trip_counters WHERE device_id LIKE 'FAULT-$TAG-%' AND zone_exits > 1"
dead_sql="SELECT count(*) FROM dead_letters"
case $PEER in
  postgres) q() { psql -qtAX "$DIRECT" -c "$1"; } ;;
  mariadb) q() { mysql -h127.0.0.1 -uroot -N -B "$NAME" -e "$1"; } ;;
  *) q() { sqlite3 "$WORK/store.db" "$1"; } ;;
esac
counted=$(q "$count_sql")
duplicated=$(q "$dup_sql")
dead=$(q "$dead_sql")
lost=$((PUBLISHED - counted))
repeat=0
if [[ $PEER == postgres || $PEER == mariadb ]]; then
  read -r sms_lost sms_dup repeat < <(curl -fsS "http://127.0.0.1:$SMS_PORT/sms/sent" "http://127.0.0.1:$SMS_PORT/sms/requests" |
    python3 -c '
import json, sys, collections
dec = json.JSONDecoder(); text = sys.stdin.read().strip(); docs = []
while text:
    v, i = dec.raw_decode(text); docs.append(v); text = text[i:].strip()
def rows(v): return v.get("sent", v.get("requests", [])) if isinstance(v, dict) else v
sent, reqs = rows(docs[0]), rows(docs[1])
per = collections.Counter(s["text"].split(" left zone")[0][len("Your vehicle "):] for s in sent)
keys = collections.Counter(r.get("idempotency_key") for r in reqs)
n = int(sys.argv[1])
tag = sys.argv[2]
print(sum(1 for i in range(n) if per.get(f"FAULT-{tag}-{i}", 0) == 0), sum(1 for c in per.values() if c > 1), sum(c - 1 for c in keys.values()))
' "$PUBLISHED" "$TAG")
  lost=$((lost + sms_lost)); duplicated=$((duplicated + sms_dup))
fi
timeouts=$(metrics | awk '/^idem_infra_errors_total\{.*kind="timeout"/ { s += $2 } END { print s + 0 }')
infra=$(metrics | awk '/^idem_infra_errors_total/ { s += $2 } END { print s + 0 }')
stalled=$(elapsed "$resumed" "$start")

cat <<EOF
peer                  $PEER
fault                 $FAULT for ${SECONDS_OF_FAULT}s
published             $PUBLISHED zone exits (consumers: ${CONSUMERS[*]} ${EXTRA[*]:-})
stalled               ${stalled}s from the fault's start to the first message processed after it
back_after_heal       ${after_heal}s
lost                  $lost
duplicated            $duplicated
dead_letters          $dead
provider_repeat_calls $repeat
infra_errors          $infra ($timeouts of kind timeout)
first_pause_seen      ${paused_seen:-none sampled}
EOF
echo "| $PEER | $FAULT | ${SECONDS_OF_FAULT} s | ${stalled} s | ${after_heal} s | $PUBLISHED | $lost | $duplicated | $dead | $repeat | $timeouts |"
[[ $lost -eq 0 && $duplicated -eq 0 && $dead -eq 0 ]]
