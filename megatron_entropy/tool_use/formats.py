"""How the policy writes tool calls and reads their results (``rollout.tools.format``).

- ``chat_template``: the model's own format through its chat template, as Qwen2.5 and Qwen3 write
  it: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one or more in a turn),
  the turn ended by the end-of-sequence token; the results come back as the template's ``tool``
  messages, rendered by the tokenizer's own template (for Qwen2.5: ``\\n<|im_start|>user\\n
  <tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``), so the
  policy sees exactly what it was trained on. The prompt lists the tools (the template's
  ``tools``).
- ``plain``: for models without a tool format: ``<call>name: argument</call>`` ends the turn (the
  argument is the tool's main parameter, e.g. the calculator's expression) and the result comes
  back as ``<result>...</result>``, after which the policy goes on.

Only the results and the template's tokens around them are inserted (as tokens, never
re-tokenising what the policy generated); they are masked out of the loss.
"""

from __future__ import annotations

import abc
import json
import re
from typing import Any, Optional

from megatron_entropy.config import ConfigError
from megatron_entropy.tool_use.pool import ToolCall
from megatron_entropy.tool_use.tools import Tool

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PLAIN = re.compile(r"<call>(.*?)(</call>|$)", re.DOTALL)


class ToolFormat(abc.ABC):
    # Strings that end a turn at a call (beside the end of sequence).
    stop: tuple[str, ...] = ()

    def __init__(self, tools: dict[str, Tool]) -> None:
        self.tools = tools

    @abc.abstractmethod
    def calls(self, text: str) -> list[ToolCall]:
        """The calls in one generated turn, in order (a malformed one with its ``error``)."""

    @abc.abstractmethod
    def results(self, texts: list[str], ended_turn: bool) -> str:
        """The text inserted after a turn whose calls gave ``texts``; ``ended_turn``: the turn
        ended with the end-of-sequence token."""

    def prompt_tools(self) -> Optional[list[dict]]:
        """The tools as the prompt's chat template lists them (None: the prompt does not)."""
        return None

    def _known(self, name: str, arguments: Any) -> ToolCall:
        if name not in self.tools:
            return ToolCall(name, {}, f"no tool named {name!r} (tools: "
                                      f"{', '.join(sorted(self.tools))})")
        return ToolCall(name, arguments)


class ChatTemplateFormat(ToolFormat):
    """Hermes-style JSON calls; results through the tokenizer's chat template."""

    def __init__(self, tools: dict[str, Tool], tokenizer: Any) -> None:
        super().__init__(tools)
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        key = "rollout.tools.format=chat_template"
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{key}: the tokenizer has no chat template; use "
                              "rollout.tools.format=plain")
        try:
            base = self._render(self._base, False)
            probe = self._tail(["R1", "R2"])
        except Exception as e:  # noqa: BLE001 - any template error: the format cannot work
            raise ConfigError(f"{key}: the tokenizer's chat template does not render tool "
                              f"messages ({type(e).__name__}: {e}); use "
                              "rollout.tools.format=plain") from None
        if "R1" not in probe or "R2" not in probe:
            raise ConfigError(f"{key}: the tokenizer's chat template drops tool messages; use "
                              "rollout.tools.format=plain")
        eos = tokenizer.eos_token or ""
        closing = base[base.rindex("A") + 1:]  # what ends an assistant message, e.g. <|im_end|>\n
        if not eos or not closing.startswith(eos):
            raise ConfigError(f"{key}: the chat template ends an assistant message with "
                              f"{closing!r}, not the tokenizer's end of sequence {eos!r}; use "
                              "rollout.tools.format=plain")
        self.eos = eos
        self.lead = closing[len(eos):]  # after the end of sequence the policy generated

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _tail(self, texts: list[str]) -> str:
        """The template's rendering of tool messages ``texts`` after an assistant message, up to
        and including the next assistant header."""
        base = self._render(self._base, False)
        full = self._render(self._base + [{"role": "tool", "content": t} for t in texts], True)
        if not full.startswith(base):
            raise ValueError("the rendering of the conversation changes when tool messages "
                             "follow")
        return full[len(base):]

    def calls(self, text: str) -> list[ToolCall]:
        out = []
        for m in _HERMES.finditer(text):
            if not m.group(2):
                out.append(ToolCall("", {}, "<tool_call> without </tool_call>"))
                continue
            try:
                call = json.loads(m.group(1).strip())
                name, arguments = call["name"], call.get("arguments", {})
                if isinstance(arguments, str):
                    arguments = json.loads(arguments)
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise TypeError("name must be a string and arguments an object")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                out.append(ToolCall("", {}, f"the tool call is not JSON with a name and "
                                            f"arguments ({type(e).__name__}: {e})"))
                continue
            out.append(self._known(name, arguments))
        return out

    def results(self, texts: list[str], ended_turn: bool) -> str:
        return ("" if ended_turn else self.eos) + self.lead + self._tail(texts)

    def prompt_tools(self) -> list[dict]:
        return [tool.schema() for tool in self.tools.values()]


class PlainFormat(ToolFormat):
    """``<call>name: argument</call>`` answered by ``<result>...</result>``."""

    stop = ("</call>",)

    def calls(self, text: str) -> list[ToolCall]:
        out = []
        for m in _PLAIN.finditer(text):
            if not m.group(2):
                continue  # cut off by the token budget: nothing to answer
            name, colon, argument = m.group(1).partition(":")
            name = name.strip()
            if not colon:
                out.append(ToolCall("", {}, "a call is written <call>name: argument</call>"))
                continue
            call = self._known(name, {})
            if call.error:
                out.append(call)
                continue
            parameter = self.tools[name].main_parameter
            if parameter is None:
                out.append(ToolCall(name, {}, f"{name} takes no single argument"))
                continue
            out.append(ToolCall(name, {parameter: argument.strip()}))
        return out

    def results(self, texts: list[str], ended_turn: bool) -> str:
        return "".join(f"<result>{t}</result>" for t in texts)


def make_format(name: str, tools: dict[str, Tool], tokenizer: Any) -> ToolFormat:
    if name == "chat_template":
        return ChatTemplateFormat(tools, tokenizer)
    if name == "plain":
        return PlainFormat(tools)
    raise ConfigError(f"rollout.tools.format={name!r}: choose chat_template or plain")
