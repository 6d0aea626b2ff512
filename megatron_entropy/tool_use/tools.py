"""The tool API, the registry of tools by name, module or file, and the built-in tools.

A tool has a ``name``, a ``description`` and ``parameters`` (the JSON schema of its arguments,
which the chat template shows the policy) and is called with the arguments the policy wrote:
``tool(**arguments) -> str`` (or a ``ToolOutput`` saying it failed). An exception is a failed
call: the policy reads ``error: <message>``. ``rollout.tools.names`` takes a registered name
(``calculator``, ``python``), ``package.module:attr`` or ``path/to/file.py:attr``, where ``attr``
is a ``Tool``, a ``Tool`` subclass (made with the ``rollout.tools`` settings if its constructor
takes them, else with none) or a plain function, whose name, first docstring line and
parameters (strings unless annotated int, float or bool) describe it.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from megatron_entropy.config import ConfigError
from megatron_entropy.rewards.registry import import_object
from megatron_entropy.tool_use.sandbox import run_python
from megatron_entropy.config.tools import ToolSettings

KEY = "rollout.tools.names"


@dataclass(frozen=True)
class ToolOutput:
    """A result with its status: ``error`` results still reach the policy (a traceback, say)."""

    text: str
    status: str = "ok"  # "ok", "error", "timeout"
    detail: str = ""  # why it failed, for the metrics' warning


class ToolError(Exception):
    """A bad call (wrong arguments, an expression that does not parse): the policy reads the
    message."""


class Tool:
    """Base of a tool (module docstring). Subclasses set ``name``, ``description``,
    ``parameters`` and implement ``__call__``."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}

    def __call__(self, **arguments: Any) -> Union[str, ToolOutput]:
        raise NotImplementedError

    def schema(self) -> dict:
        """The tool as chat templates take it (``tools=[...]``: OpenAI's function format)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def main_parameter(self) -> Optional[str]:
        """The argument a plain-format call's text goes to: the first required parameter, or
        the only one."""
        props = list(self.parameters.get("properties", {}))
        required = self.parameters.get("required", [])
        return required[0] if required else (props[0] if len(props) == 1 else None)


_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


class FunctionTool(Tool):
    """A plain function as a tool: its name, first docstring line and parameters."""

    def __init__(self, fn: Callable[..., Any], name: Optional[str] = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.description = (inspect.getdoc(fn) or "").split("\n")[0]
        props, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            annotation = p.annotation if isinstance(p.annotation, type) else \
                {"int": int, "float": float, "bool": bool}.get(str(p.annotation), str)
            props[p.name] = {"type": _JSON_TYPES.get(annotation, "string")}
            if p.default is p.empty:
                required.append(p.name)
        self.parameters = {"type": "object", "properties": props, "required": required}

    def __call__(self, **arguments: Any) -> Union[str, ToolOutput]:
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as e:
            raise ToolError(f"bad arguments for {self.name}: {e}") from None
        return self.fn(**arguments)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


class Calculator(Tool):
    """Arithmetic on numbers: + - * / // % ** and parentheses, evaluated without ``eval``."""

    name = "calculator"
    description = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    parameters = {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the expression, e.g. 13 + 7 * (2 - 5)"}},
        "required": ["expression"]}
    MAX_LENGTH = 500
    MAX_EXPONENT = 100

    def __call__(self, expression: Any = None, **extra: Any) -> str:
        if extra or not isinstance(expression, str):
            raise ToolError("calculator takes one argument, expression (a string)")
        if len(expression) > self.MAX_LENGTH:
            raise ToolError(f"expression longer than {self.MAX_LENGTH} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ToolError(f"invalid expression: {expression!r}") from None
        value = self._eval(tree.body)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ToolError("the result is not finite")
            if value.is_integer():
                value = int(value)
        return str(value)

    def _eval(self, node: ast.AST) -> Union[int, float]:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.MAX_EXPONENT:
                raise ToolError(f"exponent larger than {self.MAX_EXPONENT}")
            try:
                return _OPERATORS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
        raise ToolError(f"not arithmetic: {ast.unparse(node)!r}")


class PythonTool(Tool):
    """Python code run in the sandbox (tool_use/sandbox.py): what it prints is the result."""

    name = "python"
    description = ("Run Python code in a sandbox (no network, limited time and memory) and "
                   "return what it prints.")
    parameters = {"type": "object", "properties": {"code": {
        "type": "string", "description": "the program; print what you want to see"}},
        "required": ["code"]}

    def __init__(self, settings: ToolSettings) -> None:
        self.settings = settings

    def __call__(self, code: Any = None, **extra: Any) -> ToolOutput:
        if extra or not isinstance(code, str):
            raise ToolError("python takes one argument, code (a string)")
        s = self.settings
        result = run_python(code, s.sandbox, s.timeout_s, s.max_result_chars)
        return ToolOutput(result.output, result.status, result.detail)


BUILT_IN: dict[str, Callable[[ToolSettings], Tool]] = {
    "calculator": lambda settings: Calculator(), "python": PythonTool}


def _instantiate(obj: Any, settings: ToolSettings, spec: str) -> Tool:
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and issubclass(obj, Tool):
        takes_settings = len([p for p in inspect.signature(obj).parameters.values()
                              if p.default is p.empty]) == 1
        return obj(settings) if takes_settings else obj()
    if callable(obj):
        return FunctionTool(obj)
    raise ConfigError(f"{KEY}: {spec!r} is a {type(obj).__name__}, not a Tool or a function")


def load_tools(settings: ToolSettings) -> list[Tool]:
    """The tools ``settings.names`` names, made; raises ConfigError naming the key."""
    tools = []
    for spec in settings.names:
        if spec in BUILT_IN:
            tool = BUILT_IN[spec](settings)
        else:
            obj = import_object(spec, KEY, f"a built-in tool ({', '.join(BUILT_IN)})", "attr")
            tool = _instantiate(obj, settings, spec)
        if not tool.name or not isinstance(tool.name, str):
            raise ConfigError(f"{KEY}: {spec!r} has no name")
        tools.append(tool)
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{KEY}: two tools are named {', '.join(twice)}")
    return tools
