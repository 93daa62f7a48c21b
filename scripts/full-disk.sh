#!/usr/bin/env bash
# A full disk under `serve`'s default settings (issue 43's "Must show"): SQLite on a
# small tmpfs that fills up under a fleet trace, all four consumers, a provider that
# accepts everything. Was a provider called twice for one key, how long were the
# consumers paused, how long did they take to drain once space was freed?
#
#   scripts/full-disk.sh [HOLD_SECONDS]      default 20: how long the disk stays full
#                                            after the first consumer paused on it
#
# What it does (as root: it mounts a tmpfs; nothing shared is touched):
#   1. mounts a DISK-sized tmpfs (default 3m) for the business database; the embedded
#      queue stays on the ordinary disk, so the whole trace can wait there;
#   2. starts an SMS/ERP sandbox (answering after PROVIDER_LATENCY, default 0s) and
#      publishes a MESSAGES-message fleet trace (default 30000, `simulate`, seed 42);
#   3. starts `serve` with its default settings on that database;
#   4. polls /metrics every 0.5 s: a consumer paused with cause "store" is counted
#      paused; once the first one paused, holds the full disk HOLD_SECONDS, then frees
#      space (remounts the tmpfs at 1g);
#   5. waits until the queue is empty, and prints: provider calls per key (SMS and
#      webhooks: keys called once, twice or more), seconds paused per consumer, the
#      time from freeing space to an empty queue, dead letters.
#
# Environment: IDEMWATCH_BIN (default target/release/idemwatch, else target/debug),
# MESSAGES, DISK, PROVIDER_LATENCY, DRAIN_LIMIT seconds (default 1200).
# Exit status 0 only when no key was called twice and nothing was dead-lettered.
set -euo pipefail

HOLD=${1:-20}
MESSAGES=${MESSAGES:-30000}
DISK=${DISK:-3m}
PROVIDER_LATENCY=${PROVIDER_LATENCY:-0s}
DRAIN_LIMIT=${DRAIN_LIMIT:-1200}
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
[[ $HOLD =~ ^[0-9]+$ ]] || { echo "usage: $0 [HOLD_SECONDS]" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "$0 mounts a tmpfs: run it as root" >&2; exit 2; }

WORK=$(mktemp -d)
DISKDIR=$WORK/disk
DB="sqlite://$DISKDIR/idemwatch.db"
QUEUE="sqlite://$WORK/queue.db"
SCRATCH="sqlite://$WORK/scratch.db" # `publish` opens a store; not the one on the tmpfs
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SMS_PORT=$(port)
METRICS_PORT=$(port)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  umount -l "$DISKDIR" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$DISKDIR"
mount -t tmpfs -o "size=$DISK" tmpfs "$DISKDIR"
"$BIN" sms-sandbox --listen "127.0.0.1:$SMS_PORT" --latency "$PROVIDER_LATENCY" \
  --log-file "$WORK/sandbox.log" &
PIDS+=($!)
"$BIN" simulate --messages "$MESSAGES" >"$WORK/trace.jsonl"
"$BIN" publish --db "$SCRATCH" --queue "$QUEUE" --log-file "$WORK/publish.log" \
  "$WORK/trace.jsonl" >/dev/null
echo "published $MESSAGES messages; serve on a $DISK tmpfs (provider latency $PROVIDER_LATENCY)"

STARTED=$(date +%s.%N)
"$BIN" serve --db "$DB" --queue "$QUEUE" --sms-url "http://127.0.0.1:$SMS_PORT" \
  --listen "127.0.0.1:$METRICS_PORT" --log-file "$WORK/serve.log" &
PIDS+=($!)

left_on_queue() {
  python3 - "$WORK/queue.db" <<'EOF'
import sqlite3, sys
c = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, timeout=30)
print(c.execute("SELECT COUNT(*) FROM queue_messages").fetchone()[0])
EOF
}
paused_consumers() { # the consumers paused on the store right now, one a line
  curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics" 2>/dev/null |
    awk '/^idem_consumer_paused\{/ && /cause="store"/ && $NF == 1 { match($0, /consumer="[^"]*"/); print substr($0, RSTART + 10, RLENGTH - 11) }'
}

declare -A PAUSED_TICKS=()
FULL_AT="" FREED_AT="" DRAINED_AT=""
while :; do
  NOW=$(date +%s.%N)
  for c in $(paused_consumers); do PAUSED_TICKS[$c]=$(( ${PAUSED_TICKS[$c]:-0} + 1 )); done
  if [[ -z $FULL_AT && -n $(paused_consumers) ]]; then
    FULL_AT=$NOW
    echo "a consumer paused on the store at +$(python3 -c "print(round($NOW - $STARTED, 1))")s; $(df -h "$DISKDIR" | tail -1)"
  fi
  if [[ -n $FULL_AT && -z $FREED_AT ]] && python3 -c "import sys; sys.exit(0 if $NOW - $FULL_AT >= $HOLD else 1)"; then
    mount -o remount,size=1g "$DISKDIR"
    FREED_AT=$(date +%s.%N)
    echo "space freed after holding the full disk ${HOLD}s"
  fi
  if [[ $(left_on_queue) == 0 ]]; then
    DRAINED_AT=$(date +%s.%N)
    break
  fi
  if python3 -c "import sys; sys.exit(0 if $NOW - $STARTED > $DRAIN_LIMIT else 1)"; then
    echo "not drained within ${DRAIN_LIMIT}s" >&2
    break
  fi
  sleep 0.5
done

if [[ -z $FULL_AT ]]; then
  echo "the disk never filled (no consumer paused on the store): use a smaller DISK" >&2
fi
calls() { # ROUTE -> "keys once twice more max"
  curl -fsS "http://127.0.0.1:$SMS_PORT/$1/requests" | python3 -c '
import json, sys, collections
n = collections.Counter(r.get("idempotency_key") for r in json.load(sys.stdin))
v = list(n.values())
print(len(v), sum(1 for x in v if x == 1), sum(1 for x in v if x == 2), sum(1 for x in v if x > 2), max(v or [0]))'
}
read -r SMS_KEYS SMS_ONCE SMS_TWICE SMS_MORE SMS_MAX <<<"$(calls sms)"
read -r ERP_KEYS ERP_ONCE ERP_TWICE ERP_MORE ERP_MAX <<<"$(calls erp)"
DEAD=$("$BIN" dead-letters list --db "$DB" --json --log-file "$WORK/dl.log" 2>/dev/null |
  python3 -c 'import json,sys; d=json.load(sys.stdin); print(len(d if isinstance(d, list) else d.get("letters", d.get("dead_letters", []))))' || echo "?")
echo
echo "provider calls per key: SMS $SMS_KEYS keys ($SMS_ONCE once, $SMS_TWICE twice, $SMS_MORE more; max $SMS_MAX);" \
  "webhooks $ERP_KEYS keys ($ERP_ONCE once, $ERP_TWICE twice, $ERP_MORE more; max $ERP_MAX)"
echo -n "seconds paused on the store per consumer:"
for c in "${!PAUSED_TICKS[@]}"; do echo -n " $c $(python3 -c "print(${PAUSED_TICKS[$c]} * 0.5)")"; done
echo
if [[ -n $FREED_AT && -n $DRAINED_AT ]]; then
  echo "drained $(python3 -c "print(round($DRAINED_AT - $FREED_AT, 1))")s after space was freed;" \
    "whole run $(python3 -c "print(round($DRAINED_AT - $STARTED, 1))")s"
fi
echo "dead letters: $DEAD; left on the queue: $(left_on_queue)"
[[ $SMS_TWICE == 0 && $SMS_MORE == 0 && $ERP_TWICE == 0 && $ERP_MORE == 0 && $DEAD == 0 ]]
