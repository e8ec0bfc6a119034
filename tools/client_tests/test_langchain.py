"""LangChain's chat models against `slotstream serve` (the tool-calling
server run.sh starts): `bind_tools` and `with_structured_output` through
`langchain-ollama` and `langchain-openai`. Every call must parse and validate."""

import os

import pydantic
import pytest
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI

URL = os.environ.get("SLOTSTREAM_TOOLS_URL", "http://127.0.0.1:11434")
MODEL = os.environ.get("SLOTSTREAM_MODEL", "qwen3_moe_mlx4")


class AddNumbers(pydantic.BaseModel):
    """Add two whole numbers."""

    # Bounded: a random model's greedy digits would otherwise run to the token limit.
    a: int = pydantic.Field(ge=-1000, le=1000, description="The first number")
    b: int = pydantic.Field(ge=-1000, le=1000, description="The second number")


class Person(pydantic.BaseModel):
    """A person."""

    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def ollama_chat():
    return ChatOllama(model=MODEL, base_url=URL, temperature=0, num_predict=80)


@pytest.fixture(scope="module")
def openai_chat():
    return ChatOpenAI(model=MODEL, base_url=URL + "/v1", api_key="unused", temperature=0, max_tokens=120,
                      max_retries=0, use_responses_api=False)


def test_chat_ollama_bind_tools(ollama_chat):
    reply = ollama_chat.bind_tools([AddNumbers]).invoke("What is 2 plus 3?")
    for call in reply.tool_calls:
        assert call["name"] == "AddNumbers"
        AddNumbers.model_validate(call["args"])


def test_chat_ollama_with_structured_output(ollama_chat):
    person = ollama_chat.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person)


def test_chat_openai_bind_tools_forced(openai_chat):
    for choice in ("any", "AddNumbers"):
        reply = openai_chat.bind_tools([AddNumbers], tool_choice=choice).invoke("What is 2 plus 3?")
        assert reply.tool_calls, reply
        for call in reply.tool_calls:
            assert call["name"] == "AddNumbers" and call["id"]
            AddNumbers.model_validate(call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_chat_openai_with_structured_output(openai_chat, method):
    person = openai_chat.with_structured_output(Person, method=method).invoke("Describe a person.")
    assert isinstance(person, Person)
