#!/usr/bin/env bash
# Start a Mooncake Store for the graphgen KV pool on loopback: mooncake_master (RPC + metrics on
# 127.0.0.1) and a process holding the storage segment. Prints "ready ... url=mooncake://..." and
# runs until Ctrl-C. Usage: scripts/mooncake_master.sh [--port 50051] [--segment 1GiB]
# Some Mooncake client listeners bind 0.0.0.0: on a shared host wrap it in a private network
# namespace, e.g. unshare -n sh -c 'ip link set lo up && exec scripts/mooncake_master.sh' (root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m graphgen.runtime.pool.mooncake_server serve "$@"
