# Sourced by the benchmarks/gpu_*.sh scripts on the GPU machine, from the repository root: results
# go to $OUT (default /tmp/out). The GPU machine has no grain and no network, so grain and the
# dependencies it lacks come as wheels: every *.whl in $WHEEL_DIR (default .whl/, git-ignored) is
# installed into /tmp/site, which goes on PYTHONPATH beside the repository. Fetch them beforehand
# on a machine that reaches PyPI, from the repository root:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#     grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 importlib_resources==7.1.0
set -uo pipefail
OUT=${OUT:-/tmp/out}
WHEEL_DIR=${WHEEL_DIR:-.whl}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEEL_DIR"/*.whl >/dev/null 2>&1 || {
  echo "error: installing $WHEEL_DIR/*.whl failed (how to fetch them: benchmarks/gpu_env.sh)" >&2
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
