#!/usr/bin/env bash
# Runs every fuzz target for FUZZTIME each (default 30s): `make fuzz`.
# `make test` already runs each target's seed corpus (f.Add and
# testdata/fuzz/) as an ordinary test. A failing input is written under the
# package's testdata/fuzz/<target>/ by go test: commit it with the fix.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME="${FUZZTIME:-30s}"
# FUZZPARALLEL bounds the fuzzing processes (default: one per CPU).
par=()
[ -n "${FUZZPARALLEL:-}" ] && par=(-parallel "$FUZZPARALLEL")
targets=(
	"./rwxapi FuzzDecodeCLIState"
	"./store FuzzLegacyFile"
	"./ipc/server FuzzRequestDecoding"
	"./ipc/server FuzzExecInputFrames"
	"./ipc/client FuzzExecOutputFrames"
	"./ipc/client FuzzReadResponse"
	"./ipc/client FuzzChunkedBody"
	"./daemon/gitsync FuzzNumstatFiles"
	"./localcloud/agent FuzzSessionRequests"
	"./localcloud/agent FuzzProcessRequest"
)
total=0
for t in "${targets[@]}"; do
	set -- $t
	out=$(go test -run '^$' -fuzz "^$2\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 2s "${par[@]}" "$1" 2>&1) || { echo "$out"; echo "FAIL: $2 in $1"; exit 1; }
	n=$(echo "$out" | sed -n 's/.*execs: \([0-9]*\).*/\1/p' | tail -n1)
	total=$((total + ${n:-0}))
	printf '%-24s %-20s %10s execs\n' "$2" "$1" "${n:-?}"
done
echo "fuzz: ${#targets[@]} targets, $total executions, no failure"
