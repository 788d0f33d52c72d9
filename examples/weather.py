"""The examples' agent task: two tools, the questions, and (``--simulate-tools``) the answers
the simulator is scripted to give so that its model calls the tools (the tests use them too)."""

from __future__ import annotations

from typing import Any

from _sim import Scripts, answer, tool_call

SYSTEM = "You are a helpful assistant. Use the tools."
QUESTIONS = ("What is the weather in Paris, and what is 19 + 23?", "And in Rome?")


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 C in {city}."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def tool_round(city: str, a: int, b: int, text: str) -> list[dict[str, Any]]:
    """Scripts: the model asks for the weather in ``city`` and ``a + b``, then answers ``text``."""
    return [tool_call("get_weather", city=city), tool_call("add", a=a, b=b), answer(text)]


def scripted(*then: str, paris: str = "Paris is sunny, and 19 + 23 = 42.") -> Scripts:
    """The simulator's answers to :data:`QUESTIONS` (the tool calls, then ``paris`` and Rome's),
    then the texts ``then`` (the later questions, a summary)."""
    rome = [tool_call("get_weather", city="Rome"), answer("Rome is sunny too.")]
    return Scripts([*tool_round("Paris", 19, 23, paris), *rome, *map(answer, then)])
