"""Chat messages go through the checkpoint's chat template, not concatenation."""

import pytest

from gateway.chat import ChatTemplate
from grammar_service.default_model import resolve_model
from grammar_service.vocab import load_vocab
from protos.rpc import InvalidArgument


def test_default_model_template_marks_roles_and_adds_generation_prompt():
    vocab = load_vocab(resolve_model(None))
    bos = vocab.tokenizer.id_to_token(vocab.bos_token_id)
    text = ChatTemplate(vocab.chat_template, bos_token=bos).render(
        [("system", "be brief"), ("user", "hi")])
    assert text.startswith(bos)
    assert "<|im_start|>system\nbe brief<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = vocab.encode(text, add_special_tokens=False)
    assert ids.count(vocab.special_tokens["<|im_start|>"]) == 3  # special tokens, not text


def test_template_refusal_is_invalid_argument_on_messages():
    tpl = ChatTemplate("{% if messages[0].role != 'user' %}"
                       "{{ raise_exception('first message must be user') }}{% endif %}ok")
    assert tpl.render([("user", "x")]) == "ok"
    with pytest.raises(InvalidArgument, match="messages: .*first message must be user"):
        tpl.render([("assistant", "x")])


def test_template_cannot_reach_python_internals():
    tpl = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidArgument):
        tpl.render([("user", "x")])
