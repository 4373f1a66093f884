"""What agents and extractors send, from a venv of their own as a user has it (`make clients`:
the latest `openai` and `langchain-openai`, not the project's pins): run by tests/test_chat_serve.py
against a served chat model, `python agent_clients.py URL TOKEN MODEL`; prints one JSON object of what
each client got. Imports nothing of the project."""

from __future__ import annotations

import json
import sys
from typing import Literal

import openai
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Verdict(BaseModel):
    """A bounded answer, so that a random model's JSON ends within max_tokens."""

    verdict: Literal["yes", "no"]
    score: int = Field(ge=0, le=9)


class Digits(BaseModel):
    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


@tool(args_schema=Digits)
def add(a: int, b: int) -> int:
    """Add two digits."""
    return a + b


ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two digits", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def main(url: str, token: str, model: str) -> dict:
    out: dict = {"versions": {"openai": openai.__version__}}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120)
    question = [{"role": "user", "content": "is the cat big"}]

    parsed = client.chat.completions.parse(model=model, messages=question, response_format=Verdict, temperature=0,
                                           max_tokens=60)
    out["parse"] = {"parsed": parsed.choices[0].message.parsed.model_dump(),
                    "finish_reason": parsed.choices[0].finish_reason}

    called = client.chat.completions.create(model=model, messages=question, tools=[ADD], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "add"}},
                                            max_tokens=120)
    call = called.choices[0].message.tool_calls[0]
    history = [*question, called.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    after = client.chat.completions.create(model=model, messages=history, tools=[ADD], temperature=0, max_tokens=6)
    out["tools"] = {"name": call.function.name, "arguments": json.loads(call.function.arguments),
                    "finish_reason": called.choices[0].finish_reason,
                    "after": after.choices[0].finish_reason}

    with client.chat.completions.stream(model=model, messages=question, tools=[ADD], tool_choice="required",
                                        temperature=0, max_tokens=120) as stream:
        final = stream.get_final_completion()
    out["stream"] = {"calls": [(c.function.name, json.loads(c.function.arguments))
                               for c in final.choices[0].message.tool_calls or []],
                     "finish_reason": final.choices[0].finish_reason}

    lp = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=4, logprobs=True,
                                        top_logprobs=2)
    out["logprobs"] = {"tokens": [t.token for t in lp.choices[0].logprobs.content],
                       "content": lp.choices[0].message.content}

    llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key=token, temperature=0, max_tokens=120, max_retries=0)
    structured = llm.with_structured_output(Verdict, method="json_schema", strict=True).invoke(
        [HumanMessage("is the cat big")])
    ai = llm.bind_tools([add], tool_choice="add").invoke([HumanMessage("add two and three")])
    calls = ai.tool_calls
    follow = llm.bind_tools([add], max_tokens=6).invoke([HumanMessage("add two and three"), ai,
                                           ToolMessage(str(add.invoke(calls[0]["args"])), tool_call_id=calls[0]["id"])])
    out["langchain"] = {"structured": structured.model_dump(), "calls": [(c["name"], c["args"]) for c in calls],
                        "after": follow.response_metadata.get("finish_reason")}
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
