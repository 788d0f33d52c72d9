"""A plain ``openai``-style tool-calling agent loop on agentkv.

    python examples/openai_tool_loop.py --base-url http://127.0.0.1:8000/v1 --model MODEL

``agentkv.Client`` takes ``openai.OpenAI``'s arguments; ``client.conversation()`` keeps the
conversation id and the exact token ids, so every turn's prompt is the previous prompt + the
generated tokens + the tool results, and the router reuses the decode instance's KV.
"""

from __future__ import annotations

import json
from typing import Any

from _common import arguments, print_receipt, print_summary
from _sim import clients
from weather import QUESTIONS, SYSTEM, add, get_weather, scripted

import agentkv

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


def run_tool(name: str, args: dict[str, Any]) -> str:
    if name == "get_weather":
        return get_weather(args["city"])
    if name == "add":
        return str(add(int(args["a"]), int(args["b"])))
    return f"unknown tool {name}"


def main() -> None:
    args = arguments(__doc__ or "")
    if args.simulate_tools:
        scripts = scripted(paris="Paris is sunny (21 C), and 19 + 23 = 42.")
        client, _ = clients(args.base_url, scripts, args.api_key)
    else:
        client = agentkv.Client(base_url=args.base_url, api_key=args.api_key)
    conv = client.conversation(model=args.model, system=SYSTEM, tools=TOOLS)
    for question in QUESTIONS:
        print(f"user: {question}")
        conv.add_user(question)
        while True:
            completion = conv.create(max_tokens=256)
            assert not isinstance(completion, agentkv.ConversationStream)
            receipt = conv.last_receipt
            assert receipt is not None
            print_receipt(conv, receipt)
            message = completion.choices[0].message
            if not message.tool_calls:
                print(f"assistant: {message.content}")
                break
            for call in message.tool_calls:
                fn = call.function  # type: ignore[union-attr]
                result = run_tool(fn.name, json.loads(fn.arguments or "{}"))
                print(f"  tool {fn.name}({fn.arguments}) -> {result}")
                conv.add_tool_result(call.id, result)
    client.close()
    print_summary()


if __name__ == "__main__":
    main()
