#!/usr/bin/env bash
# Follow benches/gpu/run.sh for up to $1 seconds; copy its logs and results to $OUT.
MAX=${1:-540}; W=${W:-/tmp/w}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$SECONDS; off=0; [ -f "$W/poll.off" ] && off=$(cat "$W/poll.off")
while :; do
  if [ -f "$W/logs/driver.log" ]; then
    sz=$(stat -c %s "$W/logs/driver.log"); [ "$sz" -gt "$off" ] && { tail -c +$((off + 1)) "$W/logs/driver.log"; off=$sz; }
  fi
  [ -f "$W/DONE" ] || [ $((SECONDS - t0)) -ge "$MAX" ] && break
  sleep 5
done
echo "$off" > "$W/poll.off"
echo "--- stage=$(cat "$W/STAGE" 2>/dev/null) done=$(cat "$W/DONE" 2>/dev/null) after $((SECONDS - t0)) s"
[ -f "$W/logs/build.log" ] && echo "build: $(tail -1 "$W/logs/build.log" | cut -c1-150)"
tar czf "$OUT/results.tar.gz" -C "$W" logs results 2>/dev/null
cp "$W/results/gpu.md" "$W/results/gpu.csv" "$W/results/gpu.png" "$OUT/" 2>/dev/null
[ -f "$W/bin.tar.xz" ] && [ -n "${FETCH_BUILD:-}" ] && split -b 15M -d "$W/bin.tar.xz" "$OUT/bin.tar.xz.part"
ls -la "$OUT"
