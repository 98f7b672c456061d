#!/usr/bin/env bash
# Cases of one benchmarks/run_h200.sh stage, one after another on one device machine, in one call: the A/B of the
# capacity work (a tree against a baseline package, or an option against none, on the same card and the same warm
# caches). Each case runs the stage with a LOAD_TAG of its own (its reports' suffix) and its own variables, under a
# time limit of its own; a case the call's time left would not hold is skipped and says so. The server and the
# clients a case leaves (a limit cut it short) are killed before the next, and everything lands in one tarball,
# OUT/ab.tgz: a call brings back only a few files.
#
#   AB_BUDGET_S=570 bash benchmarks/device_ab.sh $OUT load-0.6b \
#       "-b" "-a BASELINE_PACKAGE=.whl/head.tgz" "-h100 LOAD_SERVER_ARGS=--codec-hold-ms=100"
#
# A case is "TAG [VAR=VALUE ...]" (no spaces inside a value: LOAD_SERVER_ARGS takes one option per case). The stage's
# own variables (LOAD_RATES, LOAD_WINDOW, ...) are exported by the caller for every case. AB_BUDGET_S: seconds from
# this script's start by which the last case must end (default 570, under a call's 600). AB_FIRST_S: the first
# case's limit (default 300: a fresh machine compiles the kernels and captures the graphs before the server is
# ready); AB_CASE_S: each later one's (default 120: a warm start, warm-up and a 20 s window). AB_RUNNER replaces
# benchmarks/run_h200.sh and AB_KILL the pattern of the processes killed after each case (tests/test_device_ab.py
# runs this script on a CPU with a runner of its own).
set -uo pipefail
out=${1:?output folder}; stage=${2:?stage of benchmarks/run_h200.sh}; shift 2
[ $# -gt 0 ] || { echo "give at least one case: \"TAG [VAR=VALUE ...]\"" >&2; exit 2; }
runner=${AB_RUNNER:-benchmarks/run_h200.sh}
budget=${AB_BUDGET_S:-570}
started=$(date +%s)
mkdir -p "$out/ab"
pack() { tar czf "$out/ab.tgz" -C "$out" ab && rm -rf "${out:?}/ab"; }
trap pack EXIT

limit=${AB_FIRST_S:-300}
for case in "$@"; do
  read -r -a words <<< "$case"
  tag=${words[0]}; vars=("${words[@]:1}")
  left=$((budget - $(date +%s) + started))
  if [ "$left" -lt "${AB_CASE_S:-120}" ]; then
    echo "case $tag skipped: ${left} s left of the call's budget" | tee -a "$out/ab/cases.txt"
    limit=${AB_CASE_S:-120}; continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "case $tag ($stage, ${vars[*]:-no variables}, limit ${limit} s) from $(date -u +%T)" | tee -a "$out/ab/cases.txt"
  timeout -k 5 "$limit" env LOAD_TAG="$tag" "${vars[@]}" bash "$runner" "$out/ab" "$stage" > "$out/ab/case$tag.log" 2>&1
  rc=$?
  echo "case $tag: exit $rc at $(date -u +%T)$([ $rc -eq 124 ] && echo ", cut at its limit")" | tee -a "$out/ab/cases.txt"
  grep -E "first audio|served|engine:" "$out/ab/case$tag.log" | cut -c1-600
  pkill -9 -f "${AB_KILL:-qwen3tts_agent|benchmarks\.serving}" 2> /dev/null; sleep 2
  limit=${AB_CASE_S:-120}
done
gzip -f "$out"/ab/serve-*.log 2> /dev/null
exit 0
