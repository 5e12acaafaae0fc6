"""The vocabulary loader: xgrammar's view of it agrees with Hugging Face's, bytes round-trip,
bad checkpoints are refused with the file and key named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from grammar_service.default_model import ensure_default_model
from grammar_service.vocab import Vocab, load_vocab

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age"]})
TEXTS = ['{"name": "José García", "age": 42, "tags": ["a", "🚀"]}',
         "Grüße aus München, 東京 and 😀 — plain prose.\n\tdef f(x): return x * 2"]


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def default_vocab(default_dir) -> Vocab:
    return load_vocab(default_dir)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _hf_info(model_dir: Path, vocab: Vocab) -> xgr.TokenizerInfo:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab.model_vocab_size, stop_token_ids=list(vocab.eos_token_ids))


def _masks(info: xgr.TokenizerInfo, prefixes: list[str]) -> list[torch.Tensor]:
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(SCHEMA)
    out = []
    for prefix in prefixes:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(prefix)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        out.append(bitmask.clone())
    return out


PREFIXES = ["", '{"name": "', '{"name": "Zoë", "age": 4', '{"name": "a", "age": 1, "tags": [']


def test_tokenizer_info_matches_xgrammar_from_huggingface(default_dir, default_vocab):
    ours, theirs = default_vocab.tokenizer_info(), _hf_info(default_dir, default_vocab)
    assert ours.vocab_type == theirs.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert ours.add_prefix_space == theirs.add_prefix_space
    assert ours.vocab_size == theirs.vocab_size == default_vocab.model_vocab_size
    assert ours.decoded_vocab == theirs.decoded_vocab
    assert ours.stop_token_ids == theirs.stop_token_ids
    for a, b in zip(_masks(ours, PREFIXES), _masks(theirs, PREFIXES), strict=True):
        assert torch.equal(a, b)
    assert default_vocab.tokenizer_info() is ours  # built once


def test_padded_ids_are_never_allowed_by_a_grammar(default_vocab):
    info = default_vocab.tokenizer_info()
    (mask,) = _masks(info, ['{"name": "'])  # inside a string: almost everything allowed
    ids = torch.arange(info.vocab_size)
    bits = (mask[0, ids // 32] >> (ids % 32)) & 1  # (model_vocab,) 1 = allowed
    assert int(bits[: default_vocab.vocab_size].sum()) > 3000
    assert not bits[default_vocab.vocab_size:].any()


def test_token_bytes_match_xgrammar_decoded_vocab(default_vocab):
    decoded = default_vocab.tokenizer_info().decoded_vocab
    specials = set(default_vocab.special_tokens.values())
    for token_id in range(default_vocab.model_vocab_size):
        if token_id in specials or token_id >= default_vocab.vocab_size:
            assert default_vocab.token_bytes(token_id) == b""
        else:
            assert default_vocab.token_bytes(token_id) == decoded[token_id], token_id
    with pytest.raises(ValueError, match="token_id"):
        default_vocab.token_bytes(default_vocab.model_vocab_size)
    with pytest.raises(ValueError, match="token_id"):
        default_vocab.token_bytes(-1)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_encoded_text(default_vocab, text):
    ids = default_vocab.encode(text, add_special_tokens=False)
    assert b"".join(default_vocab.token_bytes(i) for i in ids) == text.encode()
    assert default_vocab.decode(ids) == text
    # Padded ids and special tokens add nothing to the text.
    padded = default_vocab.vocab_size + 3
    assert default_vocab.decode([default_vocab.bos_token_id, *ids, padded]) == text


def test_encode_prepends_bos_only_with_special_tokens(default_vocab):
    assert default_vocab.encode("x")[0] == default_vocab.bos_token_id
    assert default_vocab.bos_token_id not in default_vocab.encode("x", add_special_tokens=False)


def test_eos_ids_are_the_union_of_all_sources(default_dir, tmp_path):
    d = _copy(default_dir, tmp_path / "m")
    _edit_json(d / "config.json", eos_token_id=[7])
    _edit_json(d / "generation_config.json", eos_token_id=[8, 7])
    vocab = load_vocab(d)
    assert vocab.eos_token_ids == (7, 8, vocab.special_tokens["<|endoftext|>"])
    assert vocab.tokenizer_info().stop_token_ids == [7, 8, vocab.special_tokens["<|endoftext|>"]]


def test_fingerprint_tracks_vocab_padding_and_eos_but_not_location(default_dir, default_vocab,
                                                                    tmp_path):
    same = _copy(default_dir, tmp_path / "same")
    assert load_vocab(same).fingerprint == default_vocab.fingerprint
    wider = _copy(default_dir, tmp_path / "wider")
    _edit_json(wider / "config.json", vocab_size=4096)
    assert load_vocab(wider).fingerprint != default_vocab.fingerprint
    eos = _copy(default_dir, tmp_path / "eos")
    _edit_json(eos / "generation_config.json", eos_token_id=None)
    assert load_vocab(eos).fingerprint != default_vocab.fingerprint


def test_optional_files_may_be_absent(default_dir, tmp_path):
    d = _copy(default_dir, tmp_path / "m")
    (d / "tokenizer_config.json").unlink()
    (d / "generation_config.json").unlink()
    vocab = load_vocab(d)
    assert vocab.chat_template is None
    assert vocab.eos_token_ids == (vocab.special_tokens["<|endoftext|>"],)
    assert vocab.add_bos_token  # observed from the post-processor


@pytest.mark.parametrize(("breakage", "message"), [
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    (lambda d: (d / "config.json").unlink(), "config.json: missing"),
    (lambda d: _edit_json(d / "config.json", vocab_size=None), "vocab_size"),
    (lambda d: _edit_json(d / "config.json", vocab_size="big"), "vocab_size"),
    (lambda d: (d / "tokenizer_config.json").write_text("{not json"), "tokenizer_config.json"),
    (lambda d: (d / "tokenizer.json").write_text('{"model": 3}'), "tokenizer.json"),
    (lambda d: _edit_json(d / "tokenizer_config.json", eos_token="<|nope|>"), "eos_token"),
    (lambda d: _edit_json(d / "config.json", eos_token_id="x"), "eos_token_id"),
    (lambda d: (_edit_json(d / "config.json", eos_token_id=None),
                (d / "generation_config.json").unlink(),
                _edit_json(d / "tokenizer_config.json", eos_token=None)), "eos_token_id"),
])
def test_bad_checkpoint_is_refused_naming_file_and_key(default_dir, tmp_path, breakage, message):
    d = _copy(default_dir, tmp_path / "m")
    breakage(d)
    with pytest.raises(ValueError, match=message):
        load_vocab(d)


def test_missing_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_vocab(tmp_path / "absent")


# ---------------------------------------------------------------- SentencePiece style


def _sentencepiece_model(out: Path) -> Path:
    """A Llama-2-style checkpoint vocabulary: "▁" for spaces, <0xXX> byte fallback pieces,
    BOS prepended. Its merges are trained on ASCII text, so other characters fall back to
    bytes."""
    text = [" ".join(["the quick brown fox jumps over the lazy dog"] * 3),
            "structured output follows a grammar", "hello world, hello there"] * 20
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer_tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(
        {"vocab_size": len(vocab) + 5, "bos_token_id": 1, "eos_token_id": 2}))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    return out


def test_sentencepiece_byte_fallback_vocab_matches_xgrammar(tmp_path):
    d = _sentencepiece_model(tmp_path / "sp")
    vocab = load_vocab(d)
    ours, theirs = vocab.tokenizer_info(), _hf_info(d, vocab)
    assert ours.vocab_type == theirs.vocab_type == xgr.VocabType.BYTE_FALLBACK
    assert ours.add_prefix_space == theirs.add_prefix_space is True
    assert ours.decoded_vocab == theirs.decoded_vocab
    for a, b in zip(_masks(ours, PREFIXES), _masks(theirs, PREFIXES), strict=True):
        assert torch.equal(a, b)


def test_sentencepiece_token_bytes_spell_spaces_and_fallback_bytes(tmp_path):
    vocab = load_vocab(_sentencepiece_model(tmp_path / "sp"))
    assert vocab.token_bytes(3 + 0xE6) == b"\xe6"
    assert vocab.token_bytes(1) == b""  # <s> is special
    text = "hello the 東京 world ü"
    ids = vocab.encode(text, add_special_tokens=False)
    assert any(3 <= i < 259 for i in ids)  # non-ASCII went through byte pieces
    # The prefix "▁" is a real byte here; the tokenizer's decoder strips it from a text.
    assert b"".join(vocab.token_bytes(i) for i in ids) == b" " + text.encode()
    assert vocab.decode(ids) == text
    assert vocab.encode(text)[0] == vocab.bos_token_id == 1 and vocab.add_bos_token
