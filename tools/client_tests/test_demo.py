"""The bundled demo model as a newcomer meets it: `slotstream serve` with no
model installed (run.sh starts it; SLOTSTREAM_DEMO_URL says where), asked the
way Open WebUI asks. Open WebUI attaches its built-in tools to every chat, over
Ollama's /api/chat or OpenAI's chat/completions; the demo's chat template reads
`tools` (rendered Qwen-style) and the demo, never taught to call, answers in
text."""

import json
import os
import urllib.request

import ollama
import openai
import pytest

URL = os.environ.get("SLOTSTREAM_DEMO_URL", "http://127.0.0.1:11434")
DEMO = "slotstream-demo"


def tool(name, description, properties=None, required=()):
    schema = {"type": "object", "properties": properties or {}, "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


# Built-in tools of the kind Open WebUI attaches to a chat: web search, page
# fetch, memory, knowledge and the time (names and wording are ours).
BUILT_IN_TOOLS = [
    tool("search_web", "Search the public web for a query and return the top results.",
         {"query": {"type": "string", "description": "What to search for."},
          "count": {"type": "integer", "description": "How many results."}}, ["query"]),
    tool("fetch_url", "Fetch a web page and return its text.", {"url": {"type": "string"}}, ["url"]),
    tool("search_memories", "Look up what the user asked to be remembered.",
         {"query": {"type": "string"}}, ["query"]),
    tool("query_knowledge_files", "Search the files attached to this chat's knowledge bases.",
         {"query": {"type": "string"}, "count": {"type": "integer"}}, ["query"]),
    tool("get_current_timestamp", "The current date and time, in UTC."),
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about the sea."},
]
OPTIONS = {"temperature": 0.8, "num_predict": 48}


def test_the_demo_is_listed_and_says_it_reads_tools():
    client = ollama.Client(host=URL)
    assert DEMO in [m.model for m in client.list().models]
    assert "tools" in (client.show(DEMO).capabilities or [])


def test_open_webui_s_ollama_chat_with_built_in_tools_answers_in_text():
    # The request as Open WebUI's Ollama connection sends it: streamed, the
    # chat's options, the tools attached, a keep_alive.
    body = {"model": DEMO, "messages": MESSAGES, "stream": True, "options": OPTIONS, "tools": BUILT_IN_TOOLS,
            "keep_alive": "5m"}
    request = urllib.request.Request(URL + "/api/chat", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        lines = [json.loads(line) for line in response if line.strip()]
    assert all("error" not in line for line in lines), lines
    assert lines[-1]["done"] and lines[-1]["done_reason"] in ("stop", "length")
    text = "".join(line["message"].get("content", "") for line in lines)
    assert text.strip(), lines
    assert not any(line["message"].get("tool_calls") for line in lines)


def test_open_webui_s_openai_connection_with_tools_answers_in_text():
    client = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=DEMO, messages=MESSAGES, tools=BUILT_IN_TOOLS, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and choice.message.content.strip()
    assert not choice.message.tool_calls


def test_a_tool_result_fed_back_to_the_demo_is_answered():
    # Open WebUI's default (prompt-based) function calling runs a tool itself
    # and sends its result back as a `tool` message.
    messages = MESSAGES[:1] + [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_current_timestamp", "arguments": {}}}]},
        {"role": "tool", "content": "2026-12-07T12:00:00Z"},
    ]
    r = ollama.Client(host=URL).chat(model=DEMO, messages=messages, tools=BUILT_IN_TOOLS, options=OPTIONS)
    assert r.done and r.message.content.strip()


def test_think_on_the_demo_is_a_clear_refusal():
    # Open WebUI offers a reasoning switch; the demo has none to honour.
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=URL).chat(model=DEMO, messages=MESSAGES, think=True, options=OPTIONS)
    assert refused.value.status_code == 400 and "thinking" in str(refused.value)
