"""tool_choice "auto" on its own: the template's format recognised, the structural tag built
and run by real xgrammar on the real Qwen3 and Llama 3.1 tokenizers (a call in the format and
free text accepted, a wrong name or bad arguments refused), and the parser giving the same
content and calls whatever pieces the text arrives in. No processes."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import xgrammar as xgr

from gateway import openai_responses as orsp
from gateway import openai_translate as ot
from gateway.tool_calls import FORMATS, Call, ToolCallParser, parse, tool_format
from gateway.validation import Limits
from grammar_service.vocab import load_vocab

DATA = Path(__file__).parent / "data" / "tokenizers"
HERMES, LLAMA = FORMATS
WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]
HI = [{"role": "user", "content": "Hi"}]


def _template(family: str) -> str:
    d = DATA / family
    if (d / "chat_template.jinja").exists():
        return (d / "chat_template.jinja").read_text()
    return json.loads((d / "tokenizer_config.json").read_text())["chat_template"]


def test_formats_are_recognised_from_real_templates():
    assert tool_format(_template("qwen3")) is HERMES
    assert tool_format(_template("llama3")) is LLAMA
    assert tool_format(_template("llama2")) is None  # renders no tools
    assert tool_format(_template("phi3")) is None
    # [TOOL_CALLS] is a special token: the detokenised text never shows it to a parser
    assert tool_format(_template("mistral_nemo")) is None
    assert tool_format(None) is None


def test_auto_without_a_known_format_is_a_400_naming_tool_choice():
    with pytest.raises(ot.OpenAIError) as info:
        ot.chat_plan({"model": "m", "messages": HI, "tools": TOOLS}, Limits(vocab_size=100),
                     _template("llama2"))
    assert info.value.status == 400 and info.value.param == "tool_choice"


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def family(request, tmp_path_factory):
    """(family, its plan for tool_choice auto, xgrammar compiler on its real tokenizer)."""
    d = tmp_path_factory.mktemp(request.param)
    for src in (DATA / request.param).iterdir():
        if src.suffix == ".gz":
            (d / src.stem).write_bytes(gzip.decompress(src.read_bytes()))
        elif src.name != "README.md":
            shutil.copy(src, d / src.name)
    size, eos = {"qwen3": (151936, 151645), "llama3": (128256, [128001, 128008, 128009])}[
        request.param]
    (d / "config.json").write_text(json.dumps({"vocab_size": size, "eos_token_id": eos}))
    vocab = load_vocab(d)
    plan = ot.chat_plan({"model": "m", "messages": HI, "tools": TOOLS},
                        Limits(vocab_size=vocab.vocab_size), vocab.chat_template)
    return request.param, plan, xgr.GrammarCompiler(vocab.tokenizer_info())


def _run(compiler, tag: str, text: str) -> bool:
    """Whether the structural tag's grammar accepts all of `text`."""
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag))
    return matcher.accept_string(text)


def test_auto_tag_accepts_text_and_calls_and_refuses_bad_calls(family):
    name, plan, compiler = family
    tag = plan.requests[0].constraint.structural_tag
    assert plan.tool.format is (HERMES if name == "qwen3" else LLAMA)
    if name == "qwen3":
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo"}}\n</tool_call>'
        wrong_name = '<tool_call>\n{"name": "get_time", "arguments": {}}'
        bad_args = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome"'
    else:
        call = '{"name": "get_weather", "parameters": {"city": "oslo"}}'
        wrong_name = '{"name": "get_time", "parameters": {}}'
        bad_args = '{"name": "get_weather", "parameters": {"city": "rome"'
    assert _run(compiler, tag, "Just text, no call.")
    assert _run(compiler, tag, "Let me look. " + call + " Done.")
    assert not _run(compiler, tag, wrong_name)
    assert not _run(compiler, tag, bad_args)
    content, calls = parse(plan.tool.format, plan.tool.schemas, "Let me look. " + call + " Done.")
    assert content == "Let me look.  Done."
    assert calls == [Call("get_weather", '{"city": "oslo"}')]


def test_parallel_tool_calls_false_allows_one_call(family):
    name, _, compiler = family
    plan = ot.chat_plan({"model": "m", "messages": HI, "tools": TOOLS,
                         "parallel_tool_calls": False}, Limits(vocab_size=10**6),
                        _template(name))
    call = ('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>' if name == "qwen3"
            else '{"name": "noop", "parameters": {}}')
    tag = plan.requests[0].constraint.structural_tag
    assert _run(compiler, tag, call)
    assert not _run(compiler, tag, call + call)


@pytest.mark.parametrize("fmt,text,content,calls", [
    (HERMES, 'Hi <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
     "Hi \n", [Call("a", '{"x": 1}'), Call("b", "{}")]),
    (HERMES, "no call < tool_call>", "no call < tool_call>", []),
    # an unknown name or an unfinished call (the token limit) stays text
    (HERMES, '<tool_call>{"name": "zz", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "zz", "arguments": {}}</tool_call>', []),
    (HERMES, '<tool_call>\n{"name": "a", "argu', '<tool_call>\n{"name": "a", "argu', []),
    (LLAMA, 'x {"name": "a", "parameters": {"x": "é"}} y {"name" z',
     'x  y {"name" z', [Call("a", '{"x": "é"}')]),
])
def test_parser_gives_the_same_result_in_any_pieces(fmt, text, content, calls):
    assert parse(fmt, {"a", "b"}, text) == (content, calls)
    for step in (1, 2, 3, 7):
        parser = ToolCallParser(fmt, {"a", "b"})
        items = []
        for k in range(0, len(text), step):
            items += parser.feed(text[k:k + step])
        items += parser.close()
        assert "".join(i for i in items if isinstance(i, str)) == content
        assert [i for i in items if isinstance(i, Call)] == calls


def test_auto_message_checks_arguments_and_drops_whitespace_content():
    plan = ot.chat_plan({"model": "m", "messages": HI, "tools": TOOLS},
                        Limits(vocab_size=100), _template("qwen3"))
    text = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo"}}\n</tool_call>'
    message, calls = orsp.auto_message(plan, 0, text)
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "oslo"}'}
    assert orsp.calls_schema_fields(plan.tool, calls) == {"schema_valid": True}
    bad = orsp.calls_schema_fields(plan.tool, [Call("get_weather", '{"city": "rome"}')])
    assert bad["schema_valid"] is False and "get_weather" in bad["schema_error"]
    message, calls = orsp.auto_message(plan, 0, "plain")
    assert message == {"role": "assistant", "content": "plain"} and not calls
