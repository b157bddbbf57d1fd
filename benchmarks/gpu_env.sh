# Sourced by the benchmarks/gpu_*.sh scripts on the GPU machine, from the repository root: results
# go to $OUT (default /tmp/out); the wheels the machine lacks (grain and its dependencies, from
# ../shared/device/wheels.sh, carried as .whl/) go on PYTHONPATH beside the repository.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1 || {
  echo "error: installing .whl/*.whl failed: run ../shared/device/wheels.sh and carry .whl" >&2
  exit 1
}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# with_fields KEY=VALUE...: the JSON object on stdin with these string fields added (a run's
# label beside the bench's --json line)
with_fields() {
  python3 -c 'import json, sys
r = json.loads(sys.stdin.read())
r.update(kv.split("=", 1) for kv in sys.argv[1:])
print(json.dumps(r))' "$@"
}
