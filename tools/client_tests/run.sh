#!/usr/bin/env bash
# Real clients against a real server: builds slotstream, serves a fixture model
# on a free port, runs the official `ollama`, `openai` and `anthropic` Python packages
# (test_clients.py, which also pulls a model from a local hub-like server,
# tiny_hub.py) and the robustness script, then stops the server. A second
# server runs the same weights with a tool-calling chat template
# (tests/templates/tool_calling.jinja) for tool calling and structured output
# (test_agents.py), and OpenAI's Responses and Anthropic's Messages APIs
# (test_responses_messages.py). A third serves the bundled demo, asked as Open
# WebUI asks, with tools attached (test_demo.py). test_litellm.py runs two
# replicas behind LiteLLM's proxy and stops one, then the other, mid-run.
# With npm, the Codex CLI and Claude Code each answer through the server.
#
#   tools/client_tests/run.sh [fixture]    (default: qwen3_moe_mlx4)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
fixture="${1:-qwen3_moe_mlx4}"
venv="$here/.venv"
queue=2

# (Re)install when requirements.txt changed since the venv was made.
if ! cmp -s "$here/requirements.txt" "$venv/requirements.installed" 2>/dev/null; then
    [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$venv/requirements.installed"
fi

# LiteLLM's proxy for test_litellm.py, apart: it pins its own versions of
# packages the clients above use.
litellm_venv="$here/.venv-litellm"
if ! cmp -s "$here/requirements-litellm.txt" "$litellm_venv/requirements.installed" 2>/dev/null; then
    [ -x "$litellm_venv/bin/pip" ] || python3 -m venv "$litellm_venv"
    "$litellm_venv/bin/pip" install --quiet -r "$here/requirements-litellm.txt"
    cp "$here/requirements-litellm.txt" "$litellm_venv/requirements.installed"
fi

cargo build --quiet --manifest-path "$root/Cargo.toml" --bin slotstream
bin="${CARGO_TARGET_DIR:-$root/target}/debug/slotstream"

scratch="$(mktemp -d)"
servers=()
trap 'for p in "${servers[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; rm -rf "$scratch"' EXIT

free_port() {
    "$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Serves the model directory $1 as $fixture (further arguments go to serve);
# sets $url and $server.
start_server() {
    start_serve --model "$1" --name "$fixture" "${@:2}"
}

# Starts `serve` with the arguments given on a free port; sets $url, $server
# and $server_log, and waits until it answers.
start_serve() {
    local port log
    port="$(free_port)"
    log="$(mktemp -p "$scratch")"
    # An empty model cache of its own: the served models are the fixture's
    # alone until a test pulls one from the local hub; and a slotstream cache
    # of its own, where the bundled demo is unpacked.
    HF_HUB_CACHE="$(mktemp -d -p "$scratch")" HF_ENDPOINT="$hub_url" HF_TOKEN= XDG_CACHE_HOME="$scratch/xdg" \
        "$bin" serve --port "$port" --queue "$queue" "$@" >"$log" 2>&1 &
    server=$!
    server_log="$log"
    servers+=("$server")
    url="http://127.0.0.1:$port"
    for _ in $(seq 1 100); do
        if "$venv/bin/python" -c "import urllib.request; urllib.request.urlopen('$url/api/version')" 2>/dev/null; then
            return 0
        fi
        if ! kill -0 "$server" 2>/dev/null; then
            echo "slotstream serve exited:" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 0.2
    done
}

# Fails when a server died during the tests.
check_alive() {
    if ! kill -0 "$1" 2>/dev/null; then
        echo "the server for $2 died during the tests" >&2
        return 1
    fi
}

# A hub-like server with the other fixture model as org/tiny, for ollama.pull.
"$venv/bin/python" "$here/tiny_hub.py" "$root/tests/fixtures/qwen3_next_mlx4" "$scratch/hub.port" &
servers+=("$!")
for _ in $(seq 1 50); do [ -s "$scratch/hub.port" ] && break; sleep 0.1; done
hub_url="http://127.0.0.1:$(cat "$scratch/hub.port")"

start_server "$root/tests/fixtures/$fixture"
plain_url="$url" plain_server="$server"
tools_model="$scratch/$fixture"
mkdir "$tools_model"
cp "$root/tests/fixtures/$fixture"/* "$tools_model/"
cp "$root/tests/templates/tool_calling.jinja" "$tools_model/chat_template.jinja"
start_server "$tools_model"
tools_url="$url" tools_server="$server"

# The robustness battery's server: short timeouts, so its slow-client cases
# take seconds, and two more copies of the fixture: one that never ends its
# answers (within a 32k context) and one whose chat template loops.
endless_model="$scratch/endless"
mkdir "$endless_model"
cp "$root/tests/fixtures/$fixture"/* "$endless_model/"
"$venv/bin/python" - "$endless_model" <<'PY'
import json, pathlib, sys
folder = pathlib.Path(sys.argv[1])
for name, key in [("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")]:
    path = folder / name
    if path.exists():
        config = json.loads(path.read_text())
        config.pop(key, None)
        if name == "config.json":
            # Room for more tokens than the server's socket buffers could hold
            # before slow clients were bounded (3 MB, some 27k tokens).
            config["max_position_embeddings"] = 32768
        path.write_text(json.dumps(config))
PY
looping_model="$scratch/looping"
mkdir "$looping_model"
cp "$root/tests/fixtures/$fixture"/* "$looping_model/"
echo '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}' \
    >"$looping_model/chat_template.jinja"
growing_model="$scratch/growing"
mkdir "$growing_model"
cp "$root/tests/fixtures/$fixture"/* "$growing_model/"
echo "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}" \
    >"$growing_model/chat_template.jinja"
timeouts=(--write-timeout-secs 2 --header-timeout-secs 2 --body-timeout-secs 2)
start_server "$root/tests/fixtures/$fixture" "${timeouts[@]}" \
    --model "$endless_model" --name endless --model "$looping_model" --name looping \
    --model "$growing_model" --name growing
battery_url="$url" battery_server="$server"

# With no model installed and none named, `serve` serves the bundled demo.
start_serve
demo_url="$url" demo_server="$server"

status=0
SLOTSTREAM_URL="$plain_url" SLOTSTREAM_MODEL="$fixture" SLOTSTREAM_HUB_MODEL="org/tiny" "$venv/bin/pytest" -q "$here/test_clients.py" || status=1
SLOTSTREAM_TOOLS_URL="$tools_url" SLOTSTREAM_MODEL="$fixture" "$venv/bin/pytest" -q "$here/test_agents.py" "$here/test_langchain.py" \
    "$here/test_responses_messages.py" || status=1
SLOTSTREAM_DEMO_URL="$demo_url" "$venv/bin/pytest" -q "$here/test_demo.py" || status=1
# Two replicas of the fixture behind LiteLLM's proxy, one drained and one
# killed mid-run (the test starts and stops them; bounded at 10 minutes).
SLOTSTREAM_BIN="$bin" SLOTSTREAM_FIXTURE_DIR="$root/tests/fixtures/$fixture" SLOTSTREAM_MODEL="$fixture" \
    LITELLM_BIN="$litellm_venv/bin/litellm" SLOTSTREAM_SCRATCH="$(mktemp -d -p "$scratch")" \
    timeout 600 "$venv/bin/pytest" -q "$here/test_litellm.py" || status=1
"$venv/bin/python" "$root/tools/robustness.py" --url "$battery_url" --model "$fixture" --queue "$queue" \
    --write-timeout 2 --header-timeout 2 --body-timeout 2 --endless-model endless --looping-model looping --growing-model growing || status=1
# Codex CLI end to end through its built-in Ollama provider (`--oss`): the
# version floor it checks, /api/tags, then a streamed /v1/responses. Its prompt
# (instructions and tools) is some 15k tokens: a copy of the tool model with
# room for it. The weights are random, so only the exchange is checked.
if command -v npm >/dev/null; then
    codex_dir="$here/.node"
    if [ ! -x "$codex_dir/node_modules/.bin/codex" ]; then
        npm install --silent --no-audit --no-fund --prefix "$codex_dir" @openai/codex@0.171.0
    fi
    codex_model="$scratch/codex"
    mkdir "$codex_model" "$scratch/codex_home" "$scratch/codex_work"
    cp "$tools_model"/* "$codex_model/"
    "$venv/bin/python" - "$codex_model/config.json" <<'PY'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1])
config = json.loads(path.read_text())
config["max_position_embeddings"] = 32768
# qwen4_exp (and other vision-language layouts) keep it in text_config.
if isinstance(config.get("text_config"), dict):
    config["text_config"]["max_position_embeddings"] = 32768
path.write_text(json.dumps(config))
PY
    start_server "$codex_model" --max-context 32768
    if (cd "$scratch/codex_work" && CODEX_HOME="$scratch/codex_home" CODEX_OSS_BASE_URL="$url/v1" timeout 300 \
            "$codex_dir/node_modules/.bin/codex" exec --oss --local-provider ollama -m "$fixture" --sandbox read-only \
            --skip-git-repo-check "Say hello." </dev/null >"$scratch/codex.out" 2>&1) \
        && grep -q "POST /v1/responses 200" "$server_log"; then
        echo "codex exec --oss: answered through /v1/responses"
    else
        echo "codex exec --oss failed:" >&2
        tail -20 "$scratch/codex.out" >&2
        tail -5 "$server_log" >&2
        status=1
    fi
    # Claude Code (`-p`) through ANTHROPIC_BASE_URL on the same server:
    # /v1/messages streamed, with one built-in tool and a short system prompt
    # (its default prompt, 24 tools, is some 45k tokens: minutes of prefill on
    # a CPU). The weights are random, so every answer runs to the output
    # limit and Claude Code gives up after asking to go on; the check is that
    # it read our streamed messages (its stream-json output repeats them).
    if [ ! -x "$codex_dir/node_modules/.bin/claude" ]; then
        npm install --silent --no-audit --no-fund --prefix "$codex_dir" @anthropic-ai/claude-code@2.1.197
    fi
    mkdir "$scratch/claude_home" "$scratch/claude_work"
    (cd "$scratch/claude_work" && HOME="$scratch/claude_home" ANTHROPIC_BASE_URL="$url" ANTHROPIC_API_KEY=unused \
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 CLAUDE_CODE_MAX_OUTPUT_TOKENS=32 timeout 300 \
        "$codex_dir/node_modules/.bin/claude" -p --model "$fixture" --tools Read --system-prompt "Be brief." \
        --output-format stream-json --verbose "Say hello." </dev/null >"$scratch/claude.out" 2>&1) || true
    if "$venv/bin/python" - "$scratch/claude.out" "$fixture" <<'PY' && grep -q "POST /v1/messages 200" "$server_log"; then
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
answers = [l["message"] for l in lines if l.get("type") == "assistant" and l["message"].get("model") == sys.argv[2]]
sys.exit(0 if any(b.get("type") == "text" and b.get("text") for m in answers for b in m["content"]) else 1)
PY
        echo "claude -p: answered through /v1/messages"
    else
        echo "claude -p failed:" >&2
        tail -20 "$scratch/claude.out" >&2
        tail -5 "$server_log" >&2
        status=1
    fi
else
    echo "npm not found: the Codex CLI and Claude Code checks did not run" >&2
fi
check_alive "$plain_server" "$fixture" || status=1
check_alive "$battery_server" "$fixture with short timeouts" || status=1
check_alive "$tools_server" "$fixture with tools" || status=1
check_alive "$demo_server" "the bundled demo" || status=1
exit "$status"
