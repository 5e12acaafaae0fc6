"""Incremental detokenisation never splits a UTF-8 character; stop strings span tokens."""

import pytest

from gateway.detokenizer import IncrementalDetokenizer, StopStringFilter
from grammar_service.default_model import resolve_model
from grammar_service.vocab import load_vocab


@pytest.fixture(scope="module")
def vocab():
    return load_vocab(resolve_model(None))


def _byte_token(vocab, byte: int) -> int:
    return next(i for i in range(vocab.vocab_size) if vocab.token_bytes(i) == bytes([byte]))


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 done",
                                  '{"name": "Zoë", "city": "Kraków"}', "plain ascii"])
def test_token_by_token_pieces_concatenate_to_the_text(vocab, text):
    detok = IncrementalDetokenizer(vocab.token_bytes)
    pieces = [detok.push([t]) for t in vocab.encode(text, add_special_tokens=True)]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_character_split_over_byte_tokens_is_held_until_complete(vocab):
    detok = IncrementalDetokenizer(vocab.token_bytes)
    raw = "🙂".encode()  # 4 bytes, fed as 4 single-byte tokens
    ids = [_byte_token(vocab, b) for b in raw]
    assert [detok.push([i]) for i in ids] == ["", "", "", "🙂"]


def test_truncated_character_at_the_end_becomes_replacement_char(vocab):
    detok = IncrementalDetokenizer(vocab.token_bytes)
    assert detok.push([_byte_token(vocab, "é".encode()[0])]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_produce_no_text(vocab):
    detok = IncrementalDetokenizer(vocab.token_bytes)
    assert detok.push(list(vocab.eos_token_ids)) == ""


def test_stop_string_spanning_pieces_is_not_emitted():
    f = StopStringFilter(["STOP"])
    out = [f.push(p) for p in ["hello S", "TO", "P and more"]]
    assert "".join(out) == "hello "
    assert f.stopped
    assert f.push("ignored") == "" and f.flush() == ""


def test_stop_string_included_when_asked():
    f = StopStringFilter(["</end>"], include_stop=True)
    assert "".join(f.push(p) for p in ["a</e", "nd>b"]) == "a</end>"


def test_earliest_of_several_stop_strings_wins():
    f = StopStringFilter(["world", "lo w"])
    assert f.push("hello world") == "hel"


def test_text_held_back_for_a_possible_stop_is_released_at_the_end():
    f = StopStringFilter(["xyz"])
    first = f.push("abcx")
    assert first == "ab"  # "cx" could still begin "xyz"
    assert first + f.flush() == "abcx"
    assert not f.stopped


def test_without_stop_strings_everything_is_emitted_at_once():
    f = StopStringFilter([])
    assert f.push("abc") == "abc"
