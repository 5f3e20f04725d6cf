#!/usr/bin/env bash
# Opt-in (not part of ./dev test; needs the package registry, a few minutes): a real `pip install`
# of each extra into a fresh venv, from a built wheel, and the command that extra is for.
# tests/test_install_extras.py checks the same without installing (isolated interpreters).
#   scripts/check_extras.sh [WORKDIR]   (default: a temporary folder, removed on exit)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"

python3 -m pip wheel -q --no-deps -w "$WORK/dist" "$REPO"
WHEEL=$(ls "$WORK"/dist/graphgen-*.whl)
mkdir -p "$WORK/proj/specs"
cp "$REPO/specs/tiny_qwen3.yaml" "$WORK/proj/specs/"

venv() {  # venv NAME EXTRAS -> prints the venv's bin folder
    local bin="$WORK/$1/bin"
    python3 -m venv "$WORK/$1"
    "$bin/python" -m pip install -q -c "$REPO/constraints.txt" "$WHEEL${2:+[$2]}"
    echo "$bin"
}

expect_exit() {  # expect_exit CODE TEXT CMD...: the command exits CODE and its stderr holds TEXT
    local want=$1 text=$2 rc=0
    shift 2
    "$@" >"$WORK/out" 2>"$WORK/err" || rc=$?
    if [ "$rc" != "$want" ] || ! grep -qF "$text" "$WORK/err"; then
        echo "FAIL: $* exited $rc (want $want, stderr with '$text'):" >&2
        cat "$WORK/err" >&2
        exit 1
    fi
}

cd "$WORK/proj"
echo "[extras] base: the build commands" >&2
B=$(venv base "")
"$B/graphgen" generate --out out >/dev/null 2>&1
diff -r "$REPO/generated/tiny_qwen3" out/tiny_qwen3
"$B/graphgen" check --out out >/dev/null
"$B/graphgen" validate specs/tiny_qwen3.yaml >/dev/null
expect_exit 2 "needs the 'runtime' extra" "$B/graphgen" run --spec specs/tiny_qwen3.yaml --weights . --prompt-ids 1

echo "[extras] runtime: graphgen run on the embedded pool" >&2
R=$(venv runtime runtime)
"$R/python" - <<'EOF'
import dataclasses
from graphgen.modelspec.loader import load_spec
from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
spec = load_spec("specs/tiny_qwen3.yaml")
write_random_hf_checkpoint("ckpt", spec.family, dataclasses.asdict(spec.dims), seed=0)
EOF
"$R/graphgen" run --spec specs/tiny_qwen3.yaml --weights ckpt --prompt-ids 1,2,3,4,5 --max-new-tokens 2
expect_exit 2 "needs the 'serve' extra" "$R/graphgen" serve --spec specs/tiny_qwen3.yaml --weights ckpt
expect_exit 2 "needs the 'mooncake' extra" "$R/graphgen" run --spec specs/tiny_qwen3.yaml --weights ckpt \
    --prompt-ids 1 --pool mooncake://127.0.0.1:1

echo "[extras] serve: the server starts (and is stopped)" >&2
S=$(venv serve serve)
"$S/graphgen" serve --spec specs/tiny_qwen3.yaml --weights ckpt --port 0 >"$WORK/serve.out" 2>&1 &
PID=$!
for _ in $(seq 100); do grep -q "listening on" "$WORK/serve.out" && break; sleep 0.3; done
kill "$PID"; wait "$PID" || true
grep -q "listening on http://127.0.0.1:" "$WORK/serve.out"

echo "[extras] mooncake: the client imports (a master is the mooncake tests' business)" >&2
M=$(venv mooncake mooncake)
"$M/python" -c "import graphgen.runtime, mooncake.store, xxhash; from graphgen.runtime.pool import mooncake"
echo "[extras] ok" >&2
