"""The tool API: the calculator against Python's own arithmetic, function tools and their schema,
``rollout.tools.names`` by name, module and file (with one clear error per bad spec), and the
call formats: what the policy writes parsed, the results written back as the templates do."""

from __future__ import annotations

import textwrap

import pytest
import transformers

from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.testing.toy_models import save_tokenizer
from megatron_entropy.tool_use.formats import ChatTemplateFormat, PlainFormat, make_format
from megatron_entropy.tool_use.pool import ToolCall, ToolPool, call_tool
from megatron_entropy.config.tools import ToolSettings
from megatron_entropy.tool_use.tools import (Calculator, FunctionTool, PythonTool, ToolError,
                                             load_tools)

# The tool-message part of Qwen2.5-Instruct's chat template (its system and tool-list parts
# left out), with the template's own tokens.
QWEN_TEMPLATE = textwrap.dedent("""\
    {%- for message in messages %}
        {%- if message.role == "user" or message.role == "system" or (message.role == "assistant" and not message.tool_calls) %}
            {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
        {%- elif message.role == "tool" %}
            {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
                {{- '<|im_start|>user' }}
            {%- endif %}
            {{- '\\n<tool_response>\\n' }}
            {{- message.content }}
            {{- '\\n</tool_response>' }}
            {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
                {{- '<|im_end|>\\n' }}
            {%- endif %}
        {%- endif %}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
    {%- endif %}""")


@pytest.mark.parametrize("expression", ["13 + 7 * (2 - 5)", "2 ** 10 - 1", "7 / 2", "-(3 % 2)",
                                        "9 // 2", "1.5 * 4"])
def test_calculator_computes_as_python(expression):
    want = eval(expression)  # noqa: S307 - the reference for the calculator's own evaluation
    want = int(want) if float(want).is_integer() else want
    assert Calculator()(expression=expression) == str(want)


@pytest.mark.parametrize("expression, why", [
    ("13+", "invalid expression"), ("__import__('os')", "not arithmetic"),
    ("1/0", "division by zero"), ("2 ** 1000", "exponent"), ("abs(-1)", "not arithmetic")])
def test_calculator_refuses_what_is_no_arithmetic(expression, why):
    with pytest.raises(ToolError, match=why):
        Calculator()(expression=expression)


def test_a_function_is_a_tool_with_its_signature_as_schema():
    def lookup(city: str, days: int = 1) -> str:
        """Weather of a city.

        Longer text the schema leaves out."""
        return f"{city}: sunny for {days} days"

    tool = FunctionTool(lookup)
    assert tool.schema() == {"type": "function", "function": {
        "name": "lookup", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}},
                       "required": ["city"]}}}
    assert tool.main_parameter == "city"
    assert tool(city="Oslo", days=2) == "Oslo: sunny for 2 days"
    with pytest.raises(ToolError, match="bad arguments for lookup"):
        tool(town="Oslo")


def test_tools_resolve_by_name_module_and_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent("""\
        from megatron_entropy.tool_use.tools import Tool

        def shout(text: str) -> str:
            "Upper case."
            return text.upper()

        class Echo(Tool):
            name = "echo"
            parameters = {"type": "object", "properties": {"text": {"type": "string"}},
                          "required": ["text"]}
            def __call__(self, text):
                return text
        """))
    tools = load_tools(ToolSettings(names=["python", f"{path}:shout", f"{path}:Echo",
                                           "megatron_entropy.tool_use.tools:Calculator"]))
    assert [type(t).__name__ for t in tools] == ["PythonTool", "FunctionTool", "Echo",
                                                 "Calculator"]
    assert [t.name for t in tools] == ["python", "shout", "echo", "calculator"]
    assert tools[1](text="hi") == "HI" and tools[0].settings.timeout_s == 10.0
    with pytest.raises(ConfigError, match="two tools are named calculator"):
        load_tools(ToolSettings(names=["calculator",
                                       "megatron_entropy.tool_use.tools:Calculator"]))


@pytest.mark.parametrize("spec, message", [
    ("calculater", "rollout.tools.names: 'calculater' is neither a built-in tool"),
    ("no_such_module:f", "rollout.tools.names: 'no_such_module:f': module not found"),
    ("megatron_entropy.tool_use.tools:NOPE", "has no attribute 'NOPE'"),
    ("megatron_entropy.tool_use.tools:KEY", "is a str, not a Tool or a function")])
def test_a_bad_tool_spec_is_one_clear_error(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_tools(ToolSettings(names=[spec]))


def test_config_checks_the_tool_settings():
    cfg = load_config(data={"rollout": {"tools": {"names": ["calculator"], "format": "plain"}}})
    assert cfg.rollout.tools.enabled and cfg.rollout.tools.max_turns == 4
    with pytest.raises(ConfigError, match="rollout.tools.max_turns: 1 with tools"):
        load_config(data={"rollout": {"tools": {"names": ["calculator"], "max_turns": 1}}})
    with pytest.raises(ConfigError, match="rollout.routing_replay=rollout replays"):
        load_config(data={"rollout": {"tools": {"names": ["calculator"]},
                                      "routing_replay": "rollout"}})


def test_calls_in_a_worker_report_errors_and_timeouts_as_results():
    tools = {t.name: t for t in load_tools(ToolSettings(names=["calculator"]))}
    ok = call_tool(tools, {"name": "calculator", "arguments": {"expression": "6*7"}}, 5.0)
    assert (ok["text"], ok["status"]) == ("42", "ok")
    bad = call_tool(tools, {"name": "calculator", "arguments": {"expression": "6*"}}, 5.0)
    assert (bad["status"], bad["text"]) == ("error", "error: invalid expression: '6*'")
    unknown = call_tool(tools, {"name": "search", "arguments": {}}, 5.0)
    assert unknown["status"] == "error" and "no tool named 'search'" in unknown["text"]


def test_the_pool_runs_calls_in_parallel_workers_and_answers_bad_calls_itself():
    pool = ToolPool(ToolSettings(names=["calculator"], workers=2))
    try:
        results = pool.run([ToolCall("calculator", {"expression": f"{i}*{i}"}) for i in range(6)]
                           + [ToolCall("", {}, "the tool call is not JSON")])
        assert [r.text for r in results] == ["0", "1", "4", "9", "16", "25",
                                             "error: the tool call is not JSON"]
        assert len(pool._workers) == 2 and all(w.running for w in pool._workers)
    finally:
        pool.close()


# ------------------------------------------------------------------ formats


def _tools() -> dict:
    return {"calculator": Calculator(), "python": PythonTool(ToolSettings())}


def test_plain_calls_parse_name_and_main_argument():
    fmt = PlainFormat(_tools())
    assert fmt.stop == ("</call>",)
    assert fmt.calls("x <call>calculator: 2+3</call>") == [
        ToolCall("calculator", {"expression": "2+3"})]
    assert fmt.calls("<call>python: print(1)\nprint(2)</call>") == [
        ToolCall("python", {"code": "print(1)\nprint(2)"})]
    assert fmt.calls("no call, and <call>calculator: 1+") == []  # cut off: nothing to answer
    (bad,) = fmt.calls("<call>search: cats</call>")
    assert bad.error.startswith("no tool named 'search'")
    (bad,) = fmt.calls("<call>calculator 2+3</call>")
    assert "<call>name: argument</call>" in bad.error
    assert fmt.results(["5", "x"], True) == "<result>5</result><result>x</result>"


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen_tok")
    save_tokenizer(out, 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_TEMPLATE
    return tok


def test_chat_template_results_are_the_templates_tool_messages(qwen_tokenizer):
    fmt = ChatTemplateFormat(_tools(), qwen_tokenizer)
    # After the policy's <|im_end|>: what Qwen2.5's template writes for two tool messages.
    assert fmt.results(["5", "10"], ended_turn=True) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n10\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert fmt.results(["5"], ended_turn=False).startswith("<|im_end|>\n<|im_start|>user")
    ids = qwen_tokenizer.encode(fmt.results(["5"], True), add_special_tokens=False)
    assert qwen_tokenizer.convert_tokens_to_ids("<|im_start|>") in ids  # one token, not text
    assert [t["function"]["name"] for t in fmt.prompt_tools()] == ["calculator", "python"]


def test_hermes_calls_parse_and_malformed_ones_are_answered(qwen_tokenizer):
    fmt = ChatTemplateFormat(_tools(), qwen_tokenizer)
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "2+3"}}\n</tool_call>\n<tool_call>\n{"name": "python", "arguments": '
            '"{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    assert fmt.calls(text) == [ToolCall("calculator", {"expression": "2+3"}),
                               ToolCall("python", {"code": "print(1)"})]
    errors = [c.error for c in fmt.calls('<tool_call>{"name": "calculator", "arguments": 3}'
                                         '</tool_call><tool_call>not json</tool_call>'
                                         '<tool_call>{"name": "x"}')]
    assert "not JSON with a name and arguments" in errors[0]
    assert "not JSON with a name and arguments" in errors[1]
    assert errors[2] == "<tool_call> without </tool_call>"


def test_a_template_without_tool_messages_is_refused(qwen_tokenizer, tmp_path):
    save_tokenizer(tmp_path, 512)
    plain = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    with pytest.raises(ConfigError, match="tokenizer has no chat template; use "
                                          "rollout.tools.format=plain"):
        make_format("chat_template", _tools(), plain)
    plain.chat_template = ("{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}"
                           "{% endif %}{% endfor %}")
    with pytest.raises(ConfigError, match="drops tool messages"):
        make_format("chat_template", _tools(), plain)
