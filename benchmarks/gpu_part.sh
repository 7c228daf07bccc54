# Sourced by the gpu_*.sh scripts: `part NAME LIMIT COMMAND...` runs one step of a budgeted run,
# its output to $OUT/NAME.log, under at most LIMIT seconds and what is left of $BUDGET since
# $start; SIGINT first, so a benchmark's `finally` stops the server it started, SIGKILL 15 s later.
# With BUNDLE set (a path outside $OUT), all of $OUT is packed into that .tgz after every part: a
# device call returns only a few files, and a run cut short still returns the parts it finished.
part() {  # name, timeout (s), command...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - start) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 10 ]; then echo "$name: skipped (out of time)"; return; fi
  local t0=$(date +%s)
  timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s (limit $limit s; log $OUT/$name.log)"
  if [ -n "${BUNDLE:-}" ]; then tar czf "$BUNDLE" -C "$OUT" .; fi
}
