"""Tool calling and structured output through the official `ollama` and
`openai` Python packages, against a `slotstream serve` of a fixture model with
a tool-calling chat template (run.sh starts it; SLOTSTREAM_TOOLS_URL says
where). The model's weights are random: whatever it would say, constrained
calls and JSON must parse and validate."""

import json
import os

import ollama
import openai
import pydantic
import pytest

URL = os.environ.get("SLOTSTREAM_TOOLS_URL", "http://127.0.0.1:11434")
MODEL = os.environ.get("SLOTSTREAM_MODEL", "qwen3_moe_mlx4")


@pytest.fixture(scope="module")
def ol():
    return ollama.Client(host=URL)


@pytest.fixture(scope="module")
def oa():
    return openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0)


def add_numbers(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
      a: The first number
      b: The second number

    Returns:
      int: The sum
    """
    return a + b


class Weather(pydantic.BaseModel):
    day: int = pydantic.Field(ge=1, le=7)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


class AddArgs(pydantic.BaseModel):
    # Bounded: a random model's greedy digits would otherwise run to max_tokens.
    model_config = pydantic.ConfigDict(extra="forbid")
    a: int = pydantic.Field(ge=-1000, le=1000)
    b: int = pydantic.Field(ge=-1000, le=1000)


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather on a day of the week",
                                      "parameters": Weather.model_json_schema() | {"additionalProperties": False}}},
    {"type": "function", "function": {"name": "add_numbers", "description": "Add two whole numbers",
                                      "parameters": AddArgs.model_json_schema()}},
]
ARGUMENTS = {"get_weather": Weather, "add_numbers": AddArgs}
ASK = [{"role": "user", "content": "What is 2 plus 3?"}]


def check_openai_call(call):
    assert call.id and call.type == "function"
    ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)


def test_ollama_tools_from_python_functions(ol):
    plain = ol.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 4})
    r = ol.chat(model=MODEL, messages=ASK, tools=[add_numbers], options={"temperature": 0, "num_predict": 24})
    # The tool's signature reached the model through its template.
    assert r.prompt_eval_count > plain.prompt_eval_count + 20
    for call in r.message.tool_calls or []:
        assert call.function.name == "add_numbers"
        AddArgs.model_validate(dict(call.function.arguments))
    pieces = list(ol.chat(model=MODEL, messages=ASK, tools=[add_numbers], stream=True,
                          options={"temperature": 0, "num_predict": 24}))
    assert pieces[-1].done
    assert "".join(p.message.content for p in pieces) == r.message.content


def test_ollama_tool_results_feed_back(ol):
    messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add_numbers", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_name": "add_numbers", "content": "5"},
    ]
    r = ol.chat(model=MODEL, messages=messages, tools=[add_numbers], options={"temperature": 0, "num_predict": 8})
    assert r.done and r.message.role == "assistant"
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model=MODEL, messages=ASK + [{"role": "tool", "tool_name": "nope", "content": "5"}], tools=[add_numbers])
    assert e.value.status_code == 400 and "answers no tool call" in e.value.error


@pytest.mark.parametrize("seed", [1, 2])
def test_ollama_format_with_a_pydantic_schema(ol, seed):
    options = {"temperature": 1, "seed": seed, "num_predict": 80}
    r = ol.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                format=Person.model_json_schema(), options=options)
    Person.model_validate_json(r.message.content)
    pieces = list(ol.generate(model=MODEL, prompt="A person:", format=Person.model_json_schema(), options=options, stream=True))
    Person.model_validate_json("".join(p.response for p in pieces))
    r = ol.generate(model=MODEL, prompt="Anything:", format="json", options={"temperature": 0, "num_predict": 40})
    assert r.response.startswith("{")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_openai_required_tool_calls_parse(oa, seed):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=160, temperature=1, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    check_openai_call(call)
    # Parallel calls: a random model may go on calling until the token limit,
    # which then ends the choice ("length"); every call returned is whole.
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                   max_tokens=160, temperature=1, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 160
    assert choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        check_openai_call(call)


def test_openai_named_tool_call_and_result(oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "add_numbers"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add_numbers"
    check_openai_call(call)
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    follow = oa.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_streamed_tool_call_deltas(oa):
    stream = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=160, temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += d.id or ""
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    for entry in calls.values():
        assert entry["id"]
        ARGUMENTS[entry["name"]].model_validate_json(entry["arguments"])


def test_openai_response_format_json_schema(oa):
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person?"}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True}})
    Person.model_validate_json(r.choices[0].message.content)
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON?"}], max_tokens=40,
                                   temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


def test_openai_parse_helper(oa):
    r = oa.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A person?"}],
                               response_format=Person, max_tokens=80, temperature=1, seed=4)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_openai_tool_errors_name_the_field(oa):
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "missing"}})
    assert "not in 'tools'" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert "'response_format' cannot be compiled" in str(e.value)
