#!/usr/bin/env bash
# Issue 23's check: engine_round's ar step (B = 1) and a ddtree round (B = 8) at two commits, in one
# device call, runs alternating (before, after, before, after) so that drift falls on both.
#   git archive BEFORE | tar -x -C .compare/before   (here; .compare in .git/info/exclude, carried)
#   dev/round_before_after.sh OUT BEFORE_COMMIT [ROUNDS]
# The checkout under test is this one (its commit from .provenance.json); the other is .compare/before.
set -uo pipefail
out=$1 before=$2 rounds=${3:-2}
args="--config moonlight-16b-a3b --batches 1 8 --budgets 16 --e2e-batches --repeats 3 --graph-repeats 50"
for i in $(seq 1 "$rounds"); do
  (cd .compare/before && DDTREE_COMMIT=$before PYTHONPATH=src timeout 300 python3 benchmarks/engine_round.py $args \
     --out "$out/before$i" > "$out/before$i.log" 2>&1; echo "before$i rc $?")
  PYTHONPATH=src timeout 300 python3 benchmarks/engine_round.py $args --out "$out/after$i" > "$out/after$i.log" 2>&1
  echo "after$i rc $?"
done
python3 dev/round_before_after.py "$out" | tee "$out/round_before_after.md"
tar -czf "$out/runs.tgz" -C "$out" $(cd "$out" && ls -d before* after*) && rm -rf "$out"/before* "$out"/after*
