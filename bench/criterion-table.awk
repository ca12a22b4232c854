# Turns `cargo bench` (criterion) console output into a Markdown table: one row per benchmark
# with its time estimate [lower, median, upper] and, when reported, the median throughput.
# Used by bench/run-all.sh (section `criterion`).
# A saved baseline adds a `change:` block whose own `time:`/`thrpt:` lines are percentages
# (a multi-line block for benchmarks with a throughput): skipped until the next benchmark.
/^[A-Za-z0-9_]+\/[^ ]+$/ { name = $1; inchange = 0; next }
/^[A-Za-z0-9_]+\/[^ ]+ +time:/ { name = $1; inchange = 0 }
/change:/ { inchange = 1; next }
inchange { next }
/time:/ {
  line = $0
  sub(/.*\[/, "", line); sub(/\].*/, "", line)
  n = split(line, t, " ")
  time[name] = t[1] " " t[2] " / **" t[3] " " t[4] "** / " t[5] " " t[6]
  order[++count] = name
  next
}
/thrpt:/ {
  line = $0
  sub(/.*\[/, "", line); sub(/\].*/, "", line)
  split(line, t, " ")
  thr[name] = t[3] " " t[4]
}
END {
  print "| Benchmark | time: lower / **median** / upper | throughput (median) |"
  print "|---|---|---|"
  for (i = 1; i <= count; i++) {
    k = order[i]
    printf "| `%s` | %s | %s |\n", k, time[k], (k in thr ? thr[k] : "")
  }
}
