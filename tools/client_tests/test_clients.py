"""The official `ollama` and `openai` Python packages against a running
`slotstream serve` (started by run.sh; SLOTSTREAM_URL and SLOTSTREAM_MODEL say
where and what). Chat and generate, streaming and not, and the refusals."""

import datetime
import os

import ollama
import openai
import pytest

URL = os.environ.get("SLOTSTREAM_URL", "http://127.0.0.1:11434")
MODEL = os.environ.get("SLOTSTREAM_MODEL", "qwen3_moe_mlx4")
GREEDY = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 8}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def ol():
    return ollama.Client(host=URL)


@pytest.fixture(scope="module")
def oa():
    return openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0)


def test_ollama_list_show_ps(ol):
    names = [m.model for m in ol.list().models]
    assert MODEL in names
    shown = ol.show(MODEL)
    assert shown.details.family
    assert "completion" in (shown.capabilities or [])
    running = ol.ps().models
    assert running and running[0].model == MODEL and running[0].size > 0


def test_ollama_generate(ol):
    r = ol.generate(model=MODEL, prompt="Once upon a time", options=GREEDY)
    assert r.done and r.done_reason in ("stop", "length")
    assert r.eval_count >= 1 and r.prompt_eval_count >= 1
    assert r.total_duration > 0 and r.context
    pieces = list(ol.generate(model=MODEL, prompt="Once upon a time", options=GREEDY, stream=True))
    assert pieces[-1].done
    assert "".join(p.response for p in pieces) == r.response


def test_ollama_chat(ol):
    r = ol.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert r.message.role == "assistant" and r.done
    pieces = list(ol.chat(model=MODEL, messages=MESSAGES, options=GREEDY, stream=True))
    assert pieces[-1].done and pieces[-1].done_reason in ("stop", "length")
    assert "".join(p.message.content for p in pieces) == r.message.content


def test_ollama_multi_turn_uses_context(ol):
    first = ol.generate(model=MODEL, prompt="Hi", options=GREEDY)
    second = ol.generate(model=MODEL, prompt="More", context=first.context, options=GREEDY)
    assert second.prompt_eval_count > len(first.context)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]}, "does not support tools"),
        ({"format": {"type": "no-such-type"}}, "'format' cannot be compiled"),
        ({"messages": [{"role": "user", "content": "x", "images": ["aGVsbG8="]}]}, "images"),
    ],
)
def test_ollama_refusals(ol, kwargs, needle):
    args = {"model": MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(**args)
    assert e.value.status_code == 400 and needle in e.value.error


def test_ollama_unknown_model(ol):
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="llama3:8b", messages=MESSAGES)
    assert e.value.status_code == 404


def test_ollama_keep_alive_ps_and_delete(ol):
    """keep_alive 0 unloads, a duration sets expires_at, the next request loads
    the model again; a served directory cannot be deleted, a bad name not pulled."""
    assert ol.generate(model=MODEL, prompt="", keep_alive=0).done_reason == "unload"
    assert MODEL not in [m.model for m in ol.ps().models]
    r = ol.generate(model=MODEL, prompt="Once upon a time", options=GREEDY, keep_alive="10m")
    assert r.done
    (running,) = [m for m in ol.ps().models if m.model == MODEL]
    left = (running.expires_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    assert 540 < left <= 600, f"keep_alive 10m: expires in {left:.0f}s"
    with pytest.raises(ollama.ResponseError) as e:
        ol.delete(MODEL)
    assert e.value.status_code == 400 and "--model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ol.pull("../not a model")
    assert e.value.status_code == 400
    assert MODEL in [m.model for m in ol.list().models]


def test_openai_models(oa):
    assert [m.id for m in oa.models.list().data] == [MODEL]


def test_openai_chat(oa):
    r = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    stream = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_openai_completions(oa):
    r = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].text for c in oa.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "does not support tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n > 1"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "images"),
        ({"max_tokens": 10_000_000}, "context"),
    ],
)
def test_openai_refusals(oa, kwargs, needle):
    args = {"model": MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(**args)
    assert needle in str(e.value)


def test_openai_embeddings_refused(oa):
    with pytest.raises(openai.BadRequestError) as e:
        oa.embeddings.create(model=MODEL, input="hello")
    assert "embeddings" in str(e.value)


def test_openai_unknown_model(oa):
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_ollama_pull_list_generate_delete(ol):
    """A model pulled from the local hub (run.sh starts tiny_hub.py) streams
    Ollama's progress, is then listed and served by name, and deleted."""
    name = os.environ.get("SLOTSTREAM_HUB_MODEL", "org/tiny")
    progress = list(ol.pull(name, stream=True))
    assert progress[0].status == "pulling manifest", progress[0]
    assert progress[-1].status == "success", progress[-1]
    assert any(p.digest and p.total and p.completed == p.total for p in progress), progress
    assert name in [m.model for m in ol.list().models]
    assert ol.generate(model=name, prompt="Once upon a time", options=GREEDY).done
    assert name in [m.model for m in ol.ps().models]
    assert ol.pull(name).status == "success"
    assert ol.delete(name).status == "success"
    assert name not in [m.model for m in ol.list().models]
    with pytest.raises(ollama.ResponseError) as e:
        ol.delete(name)
    assert e.value.status_code == 404
