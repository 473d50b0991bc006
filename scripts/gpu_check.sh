#!/usr/bin/env bash
# rlsync's GPU check (issue 24, item 8): `scripts/gpu_check.sh [--cpu] [--out FILE] [--budget SECONDS] [--stages a,b]`
# runs python/bench/gpu_check.py, which writes one results JSON (rewritten after every stage).
#
# On the GPU machine (no Rust, no network) it runs from a copy of the working tree that holds, built beforehand:
#   dist/rlsync-*.whl        the abi3 wheel (stripped), installed here with pip --no-deps --no-index --target;
#   dist/rlsync              the binary (stripped; else target/release/rlsync), for the gym_ppo stage;
#   .whl/*.whl               gymnasium, mujoco and the requirements the machine's image lacks
#                            (scripts/gpu_wheels.sh downloads them), installed beside the wheel.
# Without dist/ the `rlsync` that Python already imports is used (the test of --cpu mode runs it that way).
# PYTHON picks the interpreter (default python3); RLSYNC_CHECK_SITE the install dir (default a fresh temp dir).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
for arg in "$@"; do
    case "$arg" in
        -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exec "$PY" "$ROOT/python/bench/gpu_check.py" --help ;;
    esac
done

notes=()
shopt -s nullglob
wheels=("$ROOT"/dist/rlsync-*.whl)
extra=("$ROOT"/.whl/*.whl)
# .whl/ holds wheels for the GPU machine's Python (make gpu-dist): keep those this interpreter can install, so a
# --cpu dry run elsewhere does not fail the whole pip call on, say, a cp312 mujoco under Python 3.11.
if (( ${#extra[@]} > 0 )); then
    mapfile -t fitting < <("$PY" - "${extra[@]}" <<'PYEOF'
import sys
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename
ours = set(sys_tags())
for path in sys.argv[1:]:
    try:
        tags = parse_wheel_filename(path.rsplit("/", 1)[-1])[3]
    except Exception:
        continue
    if tags & ours:
        print(path)
PYEOF
)
    if (( ${#fitting[@]} < ${#extra[@]} )); then
        notes+=("$(( ${#extra[@]} - ${#fitting[@]} )) of ${#extra[@]} wheels in .whl/ are for another Python or platform: not installed")
    fi
    extra=("${fitting[@]}")
fi
if (( ${#wheels[@]} > 1 )); then
    echo "gpu_check: more than one wheel in dist/: ${wheels[*]}" >&2
    exit 2
fi
if (( ${#wheels[@]} + ${#extra[@]} > 0 )); then
    SITE="${RLSYNC_CHECK_SITE:-$(mktemp -d /tmp/rlsync-gpu-check-site.XXXXXX)}"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
            --upgrade --target "$SITE" "${wheels[@]}" "${extra[@]}" >"$SITE.log" 2>&1; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        notes+=("installed into $SITE: $(for w in "${wheels[@]}" "${extra[@]}"; do basename "$w"; done | tr '\n' ' ')")
    else
        notes+=("pip install of ${#wheels[@]} + ${#extra[@]} wheels failed: $(tail -3 "$SITE.log" | tr '\n' ' ')")
        echo "gpu_check: ${notes[-1]}" >&2
    fi
else
    notes+=("no dist/rlsync-*.whl and no .whl/: using the rlsync Python imports")
fi
export RLSYNC_CHECK_INSTALL="${notes[*]}"
export PYTHONUNBUFFERED=1
cd "$ROOT" || exit 2
exec "$PY" "$ROOT/python/bench/gpu_check.py" "$@"
