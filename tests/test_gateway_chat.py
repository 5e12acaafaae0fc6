"""Chat messages go through the checkpoint's chat template, rendered by transformers: the
prompt ids are apply_chat_template's, refusals are INVALID_ARGUMENT on `messages`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.chat import chat_prompt_ids, parse_tools
from grammar_service.default_model import resolve_model
from grammar_service.vocab import load_vocab
from protos.gateway_pb2 import ChatMessage
from protos.rpc import InvalidArgument

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _messages(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def _with_template(tmp_path: Path, template: str):
    """A copy of the default model whose template is only in chat_template.jinja."""
    d = tmp_path / "m"
    shutil.copytree(resolve_model(None), d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "chat_template.jinja").write_text(template)
    return load_vocab(d)


def test_default_model_prompt_is_transformers_apply_chat_template():
    vocab = load_vocab(resolve_model(None))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = chat_prompt_ids(vocab, _messages(("system", "be brief"), ("user", "hi")))
    hf = AutoTokenizer.from_pretrained(str(vocab.model_dir))
    assert ids == list(hf.apply_chat_template(msgs, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
    assert ids[0] == vocab.bos_token_id
    assert ids.count(vocab.special_tokens["<|im_start|>"]) == 3  # special tokens, not text
    assert vocab.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_separate_chat_template_jinja_is_read(tmp_path):
    vocab = _with_template(tmp_path, "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                     "{% endfor %}<|im_start|>")
    ids = chat_prompt_ids(vocab, _messages(("user", "x")))
    assert vocab.decode(ids, skip_special_tokens=False) == "[user]x<|im_start|>"


def test_strftime_now_and_tools_reach_the_template(tmp_path):
    vocab = _with_template(tmp_path, (
        "{{ strftime_now('%Y') }}|{% for t in tools %}{{ t.function.name }}{% endfor %}|"
        "{{ messages[0].content }}"))
    text = vocab.decode(chat_prompt_ids(vocab, _messages(("user", "q")), TOOLS))
    year, names, content = text.split("|")
    assert len(year) == 4 and year.isdigit() and names == "get_weather" and content == "q"


def test_tojson_keeps_non_ascii_as_transformers_does(tmp_path):
    vocab = _with_template(tmp_path, "{{ messages | tojson }}")
    text = vocab.decode(chat_prompt_ids(vocab, _messages(("user", "Zoë 東京"))))
    assert json.loads(text) == [{"role": "user", "content": "Zoë 東京"}]
    assert "Zoë 東京" in text  # not \\u escapes


def test_template_refusal_is_invalid_argument_on_messages(tmp_path):
    vocab = _with_template(tmp_path, "{% if messages[0].role != 'user' %}"
                                     "{{ raise_exception('first message must be user') }}"
                                     "{% endif %}ok")
    assert vocab.decode(chat_prompt_ids(vocab, _messages(("user", "x")))) == "ok"
    with pytest.raises(InvalidArgument, match="messages: .*first message must be user"):
        chat_prompt_ids(vocab, _messages(("assistant", "x")))


def test_template_cannot_reach_python_internals(tmp_path):
    vocab = _with_template(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidArgument, match="messages"):
        chat_prompt_ids(vocab, _messages(("user", "x")))


def test_model_without_template_refuses_messages(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(resolve_model(None), d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(InvalidArgument, match="messages: the model has no chat template"):
        chat_prompt_ids(load_vocab(d), _messages(("user", "x")))


@pytest.mark.parametrize("bad", ["{", '{"a": 1}', "[1]"])
def test_bad_tools_json_is_refused_naming_the_field(bad):
    with pytest.raises(InvalidArgument, match="tools_json"):
        parse_tools(bad)
    assert parse_tools("") is None and parse_tools(json.dumps(TOOLS)) == TOOLS
