#!/usr/bin/env bash
# The GPU lane (docs/gpu.md): on a fresh CUDA machine with torch, triton and transformers
# installed and no network, install rag_fast, run its CUDA tests and the CUDA benchmarks, and
# leave every result in OUT_DIR. Budgeted at 8 minutes on one H200 (an
# estimate: the lane has not yet run on a GPU; summary.json records each step's time).
#
#   benchmarks/gpu_check.sh OUT_DIR            the lane
#   benchmarks/gpu_check.sh --dry-run OUT_DIR  the same steps on the CPU, small shapes, Triton's
#                                              interpreter, no install (tests/test_gpu_lane.py)
#
# OUT_DIR gets summary.json (each step's status and seconds), tests.xml (JUnit), bench-*.json
# (benchmarks/run.py's JSON, one file per bench) and one .log per step. The exit status is 0
# only if every step passed; a failed step does not stop the later ones.
set -uo pipefail

usage() {
  echo "usage: $0 [--dry-run] OUT_DIR" >&2
  exit 2
}

dry_run=0
out=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h | --help) usage ;;
    -*) echo "$0: unknown option $arg" >&2; usage ;;
    *) [ -z "$out" ] || usage; out=$arg ;;
  esac
done
[ -n "$out" ] || usage

root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${PYTHON:-python}
steps=$out/steps.tsv
: >"$steps"
failed=0
lane_start=$(date +%s)

# step NAME SECONDS DIR COMMAND...: run COMMAND in DIR with a time limit, output to NAME.log.
step() {
  local name=$1 limit=$2 dir=$3
  shift 3
  local start rc status
  start=$(date +%s)
  (cd "$dir" && timeout "$limit" "$@") >"$out/$name.log" 2>&1
  rc=$?
  status=ok
  if [ "$rc" -eq 124 ]; then
    status="timed out after ${limit} s"
  elif [ "$rc" -ne 0 ]; then
    status="failed (exit $rc)"
  fi
  [ "$status" = ok ] || failed=1
  printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - start))" >>"$steps"
  printf '%-12s %-26s %4s s   %s\n' "$name" "$status" "$(($(date +%s) - start))" "$out/$name.log"
}

if [ "$dry_run" = 1 ]; then
  # The CPU stands in for the GPU: the CUDA tests run through Triton's interpreter at small
  # shapes, faiss is hidden from them as on the GPU machine, and the package is the one
  # already importable (installing would replace a developer's editable install).
  export TRITON_INTERPRET=1 RAG_FAST_GPU_LANE_DRY_RUN=1
  device=cpu
  pytest_py=(-c "import sys; sys.modules['faiss'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))")
  bench_args=(--device cpu --quick --repeats 1)
  benches=(losses)
else
  device=cuda
  # --no-deps --no-index: no network, and faiss (a dependency) is not on the GPU machine.
  step install 300 "$root" "$py" -m pip install --no-build-isolation --no-deps --no-index .
  pytest_py=(-m pytest)
  bench_args=(--device cuda --full)
  benches=(losses lm_head decoding training)
fi

step info 60 "$out" "$py" -m rag_fast.info
# The CUDA tests (marked requires_cuda) from the modules that import no faiss, run in tests/
# so that they import the installed package.
step tests 300 "$root/tests" "$py" "${pytest_py[@]}" -m requires_cuda -p no:cacheprovider -q -rs \
  --junitxml="$out/tests.xml" test_triton_kernels.py test_cuda.py test_linear_rag_nll.py
for bench in "${benches[@]}"; do
  step "bench-$bench" 240 "$root" "$py" benchmarks/run.py "${bench_args[@]}" --only "$bench" \
    --out "$out/bench-$bench.json"
done

total=$(($(date +%s) - lane_start))
"$py" - "$steps" "$out/summary.json" "$device" "$total" <<'EOF'
import json, sys

steps_tsv, summary, device, total = sys.argv[1:]
with open(steps_tsv) as f:
    steps = [dict(zip(("step", "status", "seconds"), line.rstrip("\n").split("\t")))
             for line in f if line.strip()]
for s in steps:
    s["seconds"] = int(s["seconds"])
with open(summary, "w") as f:
    json.dump({"device": device, "total_seconds": int(total), "steps": steps}, f, indent=2)
EOF
rm -f "$steps"
echo "total ${total} s; results in $out"
if [ "$dry_run" = 0 ] && [ "$total" -gt 480 ]; then
  echo "warning: the lane took longer than its 8-minute budget" >&2
fi
exit "$failed"
