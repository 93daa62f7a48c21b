#!/usr/bin/env bash
# MQTT ingest throughput (issues 20, 44): N fleet events queued by a private Mosquitto
# for the ingress's persistent session(s) while away, then `ingest mqtt` drains that
# backlog into the embedded queue (or QUEUE_URL). Prints the ingress's --json stats,
# messages per second (wall time minus the idle exit) and the peak RSS.
#
#   scripts/mqtt-ingest-bench.sh [N] [MODE]     N default 20000
#
# MODE: plain  one ingest over plain MQTT (default)
#       tls    one ingest over TLS 1.3 (a CA, a server and a client certificate made
#              here by openssl; the broker requires the client certificate)
#       shared two ingest processes in one share group ($share/fb/...), each its own
#              session, draining at once; the figure is their sum over the longer run
#
# Needs mosquitto, python3, openssl (tls) and a built idemwatch (IDEMWATCH_BIN,
# default target/profiling/idemwatch, else target/release, else target/debug:
# scripts/lib.sh). Everything
# lives in a scratch directory, deleted at the end.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
B=$BIN
N=${1:-20000}
MODE=${2:-plain}
[[ $N =~ ^[0-9]+$ && $MODE =~ ^(plain|tls|shared)$ ]] || { echo "usage: $0 [N] [plain|tls|shared]" >&2; exit 2; }
W=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
TPORT=$(free_port)
cat > "$W/m.conf" <<C
listener $PORT 127.0.0.1
allow_anonymous true
persistence false
max_queued_messages 1000000
C
[[ $(id -u) == 0 ]] && echo "user root" >> "$W/m.conf"
BROKER="mqtt://127.0.0.1:$PORT"
TLS_ARGS=()
if [[ $MODE == tls ]]; then
  ( cd "$W"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem -subj /CN=bench-ca -days 2
    for who in server client; do
      openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout $who.key -out $who.csr -subj /CN=$who
      printf 'subjectAltName=IP:127.0.0.1\n' > $who.ext
      openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $who.pem -days 2 -extfile $who.ext
    done ) >/dev/null 2>&1
  cat >> "$W/m.conf" <<C
listener $TPORT 127.0.0.1
cafile $W/ca.pem
certfile $W/server.pem
keyfile $W/server.key
require_certificate true
C
  BROKER="mqtts://127.0.0.1:$TPORT"
  TLS_ARGS=(--ca-file "$W/ca.pem" --client-cert "$W/client.pem" --client-key "$W/client.key")
fi
mosquitto -c "$W/m.conf" >/dev/null 2>&1 &
MP=$!
trap 'kill $MP 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$W"' EXIT
for p in $PORT $([[ $MODE == tls ]] && echo "$TPORT"); do
  for _ in $(seq 50); do
    timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$p" 2>/dev/null && break
    sleep 0.1
  done
done
export HOME=$W
COMMON=(--broker "$BROKER" "${TLS_ARGS[@]}" --topic 'fbench/+/events'
  --queue "${QUEUE_URL:-sqlite://$W/queue.db}" --db "sqlite://$W/db.sqlite")
MEMBERS=(fb)
SHARE=()
[[ $MODE == shared ]] && MEMBERS=(fb-a fb-b) && SHARE=(--share-group fb)
# The persistent sessions (subscribed), then away.
for m in "${MEMBERS[@]}"; do
  IDEMWATCH_LOG_FILE=$W/$m.log "$B" ingest mqtt "${COMMON[@]}" --client-id "$m" "${SHARE[@]}" \
    --idle-exit 2s --json > "$W/first-$m.json"
done
"$B" simulate --mqtt "mqtt://127.0.0.1:$PORT" --topic-prefix fbench --messages "$N" --vehicles 50 \
  --dup-rate 0.01 --log-file "$W/sim.log" > "$W/sim.out"
T0=$(date +%s.%N)
PIDS=()
for m in "${MEMBERS[@]}"; do
  IDEMWATCH_LOG_FILE=$W/$m.log /usr/bin/time -f '%M' -o "$W/rss-$m" "$B" ingest mqtt "${COMMON[@]}" \
    --client-id "$m" "${SHARE[@]}" --idle-exit 3s --json > "$W/ingest-$m.json" &
  PIDS+=($!)
done
wait "${PIDS[@]}"
T1=$(date +%s.%N)
echo "mode: $MODE; devices: $(tail -1 "$W/sim.out")"
python3 - "$T0" "$T1" "$W" "${MEMBERS[@]}" <<'PY'
import json, sys
t0, t1, w, members = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:]
dt = t1 - t0 - 3.0
total = 0
for m in members:
    s = json.load(open(f"{w}/ingest-{m}.json"))
    rss = int(open(f"{w}/rss-{m}").read().split()[-1]) // 1024
    total += s["received"]
    print(f"ingest {m}: {json.dumps(s)}; peak RSS {rss} MiB")
print(f"received {total} in {dt:.2f} s (wall minus the 3 s idle exit) = {total / dt:,.0f} msg/s")
PY
