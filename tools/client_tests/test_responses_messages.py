"""OpenAI's Responses API and Anthropic's Messages API through the official
`openai` and `anthropic` Python packages, against a `slotstream serve` of a
fixture model with a tool-calling chat template (run.sh starts it;
SLOTSTREAM_TOOLS_URL says where). The weights are random: forced calls and
JSON must parse and validate whatever the model would say."""

import json
import os
import urllib.request

import anthropic
import openai
import pydantic
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

URL = os.environ.get("SLOTSTREAM_TOOLS_URL", "http://127.0.0.1:11434")
MODEL = os.environ.get("SLOTSTREAM_MODEL", "qwen3_moe_mlx4")


class AddArgs(pydantic.BaseModel):
    # Bounded: a random model's greedy digits would otherwise run to the limit.
    model_config = pydantic.ConfigDict(extra="forbid")
    a: int = pydantic.Field(ge=-1000, le=1000)
    b: int = pydantic.Field(ge=-1000, le=1000)


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


ADD = {"name": "add_numbers", "description": "Add two whole numbers", "schema": AddArgs.model_json_schema()}


@pytest.fixture(scope="module")
def oa():
    return openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an():
    return anthropic.Anthropic(base_url=URL, api_key="unused", max_retries=0, timeout=120)


# --- OpenAI Responses ----------------------------------------------------------------


def test_responses_create_plain_and_streamed(oa):
    r = oa.responses.create(model=MODEL, instructions="Be brief.", input="Say hello.", max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    with oa.responses.stream(model=MODEL, instructions="Be brief.", input="Say hello.", max_output_tokens=12,
                             temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text
    # The raw event stream too (what Codex reads).
    events = list(oa.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_forced_function_call_beside_web_search(oa):
    tools = [{"type": "web_search"},
             {"type": "function", "name": ADD["name"], "description": ADD["description"], "parameters": ADD["schema"],
              "strict": True}]
    r = oa.responses.create(model=MODEL, input="What is 2 plus 3?", tools=tools, max_output_tokens=120, temperature=0,
                            tool_choice={"type": "function", "name": "add_numbers"})
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "add_numbers" and call.call_id
    AddArgs.model_validate_json(call.arguments)
    # Its output back, as Codex sends it.
    follow = oa.responses.create(model=MODEL, tools=tools, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "What is 2 plus 3?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ])
    assert follow.status in ("completed", "incomplete")
    # Streamed: the arguments arrive as deltas of one function_call item.
    with oa.responses.stream(model=MODEL, input="What is 2 plus 3?", tools=tools, max_output_tokens=120, temperature=0,
                             tool_choice="required", parallel_tool_calls=False) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.arguments == arguments
    json.loads(arguments)


def test_responses_json_schema(oa):
    r = oa.responses.create(model=MODEL, input="Describe a person.", max_output_tokens=80, temperature=0, text={
        "format": {"type": "json_schema", "name": "person", "schema": Person.model_json_schema(), "strict": True}})
    Person.model_validate_json(r.output_text)
    parsed = oa.responses.parse(model=MODEL, input="Describe a person.", text_format=Person, max_output_tokens=80,
                                temperature=0)
    assert isinstance(parsed.output_parsed, Person)


def test_responses_refusals(oa):
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model="gpt-5", input="Hi")


# --- Anthropic Messages -----------------------------------------------------------------

TOOL = {"name": ADD["name"], "description": ADD["description"], "input_schema": ADD["schema"]}
# The SDK no longer has sampling arguments; the server still reads them (older clients send them).
GREEDY = {"extra_body": {"temperature": 0}}


def test_messages_create_and_stream(an):
    m = an.messages.create(model=MODEL, max_tokens=12, **GREEDY, system="Be brief.",
                           messages=[{"role": "user", "content": "Say hello."}])
    assert m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in m.content if b.type == "text")
    with an.messages.stream(model=MODEL, max_tokens=12, **GREEDY, system="Be brief.",
                            messages=[{"role": "user", "content": "Say hello."}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens


def test_messages_forced_tool_use_and_result(an):
    m = an.messages.create(model=MODEL, max_tokens=120, **GREEDY, tools=[TOOL],
                           tool_choice={"type": "tool", "name": "add_numbers"},
                           messages=[{"role": "user", "content": "What is 2 plus 3?"}])
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "add_numbers"
    AddArgs.model_validate(use.input)
    with an.messages.stream(model=MODEL, max_tokens=120, **GREEDY, tools=[TOOL],
                            tool_choice={"type": "any", "disable_parallel_tool_use": True},
                            messages=[{"role": "user", "content": "What is 2 plus 3?"}]) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    AddArgs.model_validate(streamed.input)
    follow = an.messages.create(model=MODEL, max_tokens=4, tools=[TOOL], messages=[
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
    ])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_messages_structured_output(an):
    m = an.messages.create(model=MODEL, max_tokens=80, **GREEDY, messages=[{"role": "user", "content": "A person?"}],
                           output_config={"format": {"type": "json_schema", "schema": Person.model_json_schema()}})
    Person.model_validate_json("".join(b.text for b in m.content if b.type == "text"))


def test_messages_count_tokens(an):
    messages = [{"role": "user", "content": "Say hello."}]
    counted = an.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    m = an.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=messages)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    with_tools = an.messages.count_tokens(model=MODEL, messages=messages, tools=[TOOL])
    assert with_tools.input_tokens > counted.input_tokens


def test_messages_errors(an):
    with pytest.raises(anthropic.NotFoundError) as e:
        an.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "5"}]}])
    assert "toolu_9" in str(e.value)


# --- Serving operations -----------------------------------------------------------------


def scrape():
    with urllib.request.urlopen(URL + "/metrics", timeout=30) as r:
        assert "openmetrics-text" in r.headers["Content-Type"]
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    return families


def count(families, name, **labels):
    """The `_count` of histogram `name`, or the value of counter `name`, for `labels`."""
    family = families.get(name)
    if family is None:
        return 0
    suffix = "_count" if family.type == "histogram" else "_total"
    return sum(s.value for s in family.samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_parse_and_move_with_requests(oa):
    before = scrape()
    oa.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    after = scrape()
    for name in ["slotstream:e2e_request_latency_seconds", "slotstream:time_to_first_token_seconds"]:
        assert after[name].type == "histogram"
        assert count(after, name, model_name=MODEL) == count(before, name, model_name=MODEL) + 1, name
    assert count(after, "slotstream:generation_tokens", model_name=MODEL) > count(before, "slotstream:generation_tokens", model_name=MODEL)
    assert count(after, "slotstream:http_requests", endpoint="/v1/responses", status="200") >= 1
    for name in ["slotstream:num_requests_running", "slotstream:num_requests_waiting", "slotstream:expert_pool_hits",
                 "slotstream:prefix_cache_queries", "slotstream:inter_token_latency_seconds"]:
        assert name in after, name
    with urllib.request.urlopen(URL + "/health/ready", timeout=30) as r:
        assert r.status == 200 and json.load(r)["status"] == "ready"
