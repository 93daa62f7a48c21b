#!/usr/bin/env bash
# MQTT ingest throughput (issue 20): N fleet events queued by a private Mosquitto for
# the ingress's persistent session while it was away, then `ingest mqtt` drains that
# backlog into the embedded queue. Prints the ingress's --json stats, messages per
# second (wall time minus the idle exit) and its peak RSS.
#
#   scripts/mqtt-ingest-bench.sh [N]      default 20000
#
# Needs mosquitto, python3 and a built idemwatch (IDEMWATCH_BIN, default
# target/profiling/idemwatch, else target/release, else target/debug: scripts/lib.sh). Everything lives in a scratch directory, deleted at the end.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
B=$BIN
N=${1:-20000}
[[ $N =~ ^[0-9]+$ ]] || { echo "usage: $0 [N]" >&2; exit 2; }
W=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$W/m.conf" <<C
listener $PORT 127.0.0.1
allow_anonymous true
persistence false
max_queued_messages 1000000
C
[[ $(id -u) == 0 ]] && echo "user root" >> "$W/m.conf"
mosquitto -c "$W/m.conf" >/dev/null 2>&1 &
MP=$!
trap 'kill $MP 2>/dev/null || true; rm -rf "$W"' EXIT
for _ in $(seq 50); do
  timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT" 2>/dev/null && break
  sleep 0.1
done
export HOME=$W IDEMWATCH_LOG_FILE=$W/ingest.log
ING=("$B" ingest mqtt --broker "mqtt://127.0.0.1:$PORT" --topic 'fbench/+/events' --client-id fb
  --queue "sqlite://$W/queue.db" --db "sqlite://$W/db.sqlite")
# The persistent session (subscribed), then away.
"${ING[@]}" --idle-exit 2s --json > "$W/first.json"
"$B" simulate --mqtt "mqtt://127.0.0.1:$PORT" --topic-prefix fbench --messages "$N" --vehicles 50 \
  --dup-rate 0.01 --log-file "$W/sim.log" > "$W/sim.out"
T0=$(date +%s.%N)
/usr/bin/time -f '%M' -o "$W/rss" "${ING[@]}" --idle-exit 3s --json > "$W/ingest.json"
T1=$(date +%s.%N)
echo "devices: $(tail -1 "$W/sim.out")"
python3 - "$W/ingest.json" "$T0" "$T1" "$(cat "$W/rss")" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
dt = float(sys.argv[3]) - float(sys.argv[2]) - 3.0
print(f"ingest: {json.dumps(s)}")
print(f"received {s['received']} in {dt:.2f} s (wall minus the 3 s idle exit) = "
      f"{s['received'] / dt:,.0f} msg/s; peak RSS {int(sys.argv[4]) // 1024} MiB")
PY
