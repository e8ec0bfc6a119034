#!/usr/bin/env bash
# Real clients against a real server: builds slotstream, serves a fixture model
# on a free port, runs the official `ollama` and `openai` Python packages
# (test_clients.py) and the 60-case robustness script, then stops the server.
#
#   tools/client_tests/run.sh [fixture]    (default: qwen3_moe_mlx4)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
fixture="${1:-qwen3_moe_mlx4}"
venv="$here/.venv"
queue=2

if [ ! -x "$venv/bin/pytest" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet -r "$here/requirements.txt"
fi

cargo build --quiet --manifest-path "$root/Cargo.toml" --bin slotstream
bin="${CARGO_TARGET_DIR:-$root/target}/debug/slotstream"

port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$(mktemp)"
"$bin" serve --model "$root/tests/fixtures/$fixture" --port "$port" --queue "$queue" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT

url="http://127.0.0.1:$port"
for _ in $(seq 1 100); do
    if "$venv/bin/python" -c "import urllib.request; urllib.request.urlopen('$url/api/version')" 2>/dev/null; then
        break
    fi
    if ! kill -0 "$server" 2>/dev/null; then
        echo "slotstream serve exited:" >&2
        cat "$log" >&2
        exit 1
    fi
    sleep 0.2
done

status=0
SLOTSTREAM_URL="$url" SLOTSTREAM_MODEL="$fixture" "$venv/bin/pytest" -q "$here/test_clients.py" || status=1
"$venv/bin/python" "$root/tools/robustness.py" --url "$url" --model "$fixture" --queue "$queue" || status=1
if ! kill -0 "$server" 2>/dev/null; then
    echo "the server died during the tests:" >&2
    cat "$log" >&2
    status=1
fi
exit "$status"
