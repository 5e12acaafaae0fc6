"""The model's vocabulary: tokenizer, special ids, fingerprint and xgrammar's view of it.

Everything is read from a Hugging Face checkpoint directory (tokenizer.json, config.json,
optional tokenizer_config.json and generation_config.json) with the `tokenizers` library
alone; transformers is not needed at run time. The fingerprint names the vocabulary a
compiled grammar belongs to: a grammar compiled against one fingerprint must never drive a
model with another.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import xgrammar as xgr

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte value.

    Bytes that are printable Latin-1 stand for themselves; the other 68 are shifted to
    code points 256.. so every byte has a visible, non-whitespace character.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL_DECODER = _byte_level_decoder()


@dataclass(frozen=True, eq=False)
class Vocab:
    """A model's vocabulary as loaded by `load_vocab`. Immutable; safe to share between threads.

    `vocab_size` counts the tokenizer's ids (added tokens included); `model_vocab_size` is
    the model's embedding/LM-head size, which may be larger (padded ids that no text maps
    to). Rendered chat templates already contain the BOS token when the template writes it,
    so encode them with `add_special_tokens=False`, as Hugging Face does.
    """

    model_dir: Path
    tokenizer: tokenizers.Tokenizer
    vocab_size: int
    model_vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    special_tokens: dict[str, int]
    fingerprint: str
    vocab_type: xgr.VocabType
    add_prefix_space: bool
    # id -> raw token string as stored in tokenizer.json ("" for holes), len == vocab_size.
    raw_tokens: tuple[str, ...] = field(repr=False)
    special_ids: frozenset[int] = field(repr=False)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        """xgrammar's TokenizerInfo for this vocabulary, built once and then cached.

        The token mask has `model_vocab_size` entries; padded ids decode to nothing, so no
        grammar ever allows them. Stop tokens are `eos_token_ids`.
        """
        with self._lock:
            info = self._cache.get("tokenizer_info")
            if info is None:
                encoded = list(self.raw_tokens[: self.model_vocab_size])
                encoded += [""] * (self.model_vocab_size - len(encoded))
                info = xgr.TokenizerInfo(
                    encoded, self.vocab_type, vocab_size=self.model_vocab_size,
                    stop_token_ids=list(self.eos_token_ids),
                    add_prefix_space=self.add_prefix_space)
                self._cache["tokenizer_info"] = info
            return info

    def llguidance_tokenizer(self):
        """llguidance's LLTokenizer for this vocabulary, built once and then cached: the same
        `tokenizers` object, `model_vocab_size` ids (as tokenizer_info) and `eos_token_ids`."""
        with self._lock:
            tok = self._cache.get("llguidance_tokenizer")
            if tok is None:
                from grammar_service.backends import llguidance_tokenizer

                tok = llguidance_tokenizer(self.tokenizer.to_str(), self.model_vocab_size,
                                           self.eos_token_ids)
                self._cache["llguidance_tokenizer"] = tok
            return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer's post-processor
        adds what it adds (BOS for the default model). No state changes."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Padded ids (>= vocab_size) are dropped; special tokens are dropped
        unless `skip_special_tokens` is False."""
        kept = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for, for incremental detokenisation.

        b"" for special tokens, holes and padded ids (vocab_size <= id < model_vocab_size).
        A SentencePiece-style "▁" is a space here, also at the start of a text (the
        tokenizer's decoder would strip that one). Raises ValueError for an id outside
        [0, max(vocab_size, model_vocab_size)).
        """
        limit = max(self.vocab_size, self.model_vocab_size)
        if not 0 <= token_id < limit:
            raise ValueError(f"token_id: {token_id} is outside [0, {limit})")
        table = self._cache.get("token_bytes")
        if table is None:
            with self._lock:
                table = self._cache.get("token_bytes")
                if table is None:
                    table = self._token_bytes_table()
                    self._cache["token_bytes"] = table
        return table[token_id] if token_id < len(table) else b""

    def _token_bytes_table(self) -> tuple[bytes, ...]:
        added = {i: t for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        out = []
        for token_id, raw in enumerate(self.raw_tokens):
            if token_id in self.special_ids or not raw:
                out.append(b"")
            elif token_id in added:
                # Added tokens are stored as the text they match, not in the model's alphabet.
                out.append(added[token_id].content.encode())
            else:
                out.append(_raw_token_bytes(raw, self.vocab_type))
        return tuple(out)


def _raw_token_bytes(raw: str, vocab_type: xgr.VocabType) -> bytes:
    if vocab_type == xgr.VocabType.BYTE_LEVEL:
        # A character outside the byte alphabet cannot come from the trainer; keep its UTF-8.
        return b"".join(bytes([_BYTE_LEVEL_DECODER[c]]) if c in _BYTE_LEVEL_DECODER
                        else c.encode() for c in raw)
    if vocab_type == xgr.VocabType.BYTE_FALLBACK:
        piece = _BYTE_PIECE.fullmatch(raw)
        if piece:
            return bytes([int(piece.group(1), 16)])
        return raw.replace(_SPIECE_SPACE, " ").encode()
    return raw.encode()


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ValueError(f"{path}: missing (required in a model directory)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _components(node: Any, key: str) -> list[dict[str, Any]]:
    """The parts of a tokenizer.json component, flattening `Sequence` nodes."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get(key, []) for p in _components(child, key)]
    return [node]


def _detect_vocab_type(spec: dict[str, Any], raw_tokens: Sequence[str]) -> xgr.VocabType:
    """How the vocabulary spells bytes, from tokenizer.json's decoder and model, agreeing
    with xgrammar.TokenizerInfo.from_huggingface (which also trusts <0xXX> pieces)."""
    decoders = {d.get("type") for d in _components(spec.get("decoder"), "decoders")}
    model = spec.get("model") or {}
    vocab = set(raw_tokens)
    if sum(f"<0x{b:02X}>" in vocab for b in range(256)) >= 128:
        return xgr.VocabType.BYTE_FALLBACK
    if "ByteFallback" in decoders or model.get("byte_fallback"):
        return xgr.VocabType.BYTE_FALLBACK
    if "ByteLevel" in decoders:
        return xgr.VocabType.BYTE_LEVEL
    return xgr.VocabType.RAW


def _detect_add_prefix_space(spec: dict[str, Any], vocab_type: xgr.VocabType) -> bool:
    """Whether tokenisation prepends "▁" to a text (SentencePiece style). Byte-level
    vocabularies are False, as xgrammar treats them."""
    if vocab_type == xgr.VocabType.BYTE_LEVEL:
        return False
    for norm in _components(spec.get("normalizer"), "normalizers"):
        if norm.get("type") == "Prepend" and norm.get("prepend") == _SPIECE_SPACE:
            return True
    for pre in _components(spec.get("pre_tokenizer"), "pretokenizers"):
        if pre.get("type") == "Metaspace":
            scheme = pre.get("prepend_scheme")
            if scheme in ("always", "first") or (scheme is None and pre.get("add_prefix_space")):
                return True
    return False


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: expected a non-negative int or a list of them, got {value!r}")
    return list(values)


def _fingerprint(raw_tokens: Sequence[str], added: list[list[Any]], model_vocab_size: int,
                 eos: Sequence[int], vocab_type: xgr.VocabType, add_prefix_space: bool) -> str:
    digest = hashlib.sha256()
    payload = {"tokens": list(raw_tokens), "added": added, "model_vocab_size": model_vocab_size,
               "eos": list(eos), "vocab_type": int(vocab_type.value),
               "add_prefix_space": add_prefix_space}
    digest.update(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())
    return digest.hexdigest()


def load_vocab(model_dir: str | Path) -> Vocab:
    """Load the vocabulary of the Hugging Face checkpoint in `model_dir`.

    Reads tokenizer.json and config.json (required: "vocab_size"), and tokenizer_config.json
    and generation_config.json when present. EOS ids are the union, in that order, of
    config.json's eos_token_id, generation_config.json's eos_token_id and tokenizer_config's
    eos_token. Raises ValueError naming the missing or bad file or key (no EOS id anywhere
    is an error).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: not a directory")
    tok_path = model_dir / "tokenizer.json"
    spec = _read_json(tok_path, required=True)
    config = _read_json(model_dir / "config.json", required=True)
    tok_config = _read_json(model_dir / "tokenizer_config.json", required=False) or {}
    gen_config = _read_json(model_dir / "generation_config.json", required=False) or {}
    try:
        tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ValueError(f"{tok_path}: not a tokenizer: {exc}") from exc

    token_to_id = tokenizer.get_vocab(with_added_tokens=True)
    vocab_size = max(len(token_to_id), max(token_to_id.values(), default=-1) + 1)
    raw = [""] * vocab_size
    for token, token_id in token_to_id.items():
        raw[token_id] = token

    model_vocab_size = config.get("vocab_size")
    if not isinstance(model_vocab_size, int) or model_vocab_size <= 0:
        raise ValueError(f"{model_dir / 'config.json'}: vocab_size: expected a positive int, "
                         f"got {model_vocab_size!r}")

    def lookup(content: str | None, where: str) -> int | None:
        if content is None:
            return None
        token_id = tokenizer.token_to_id(content)
        if token_id is None:
            raise ValueError(f"{where}: token {content!r} is not in {tok_path}")
        return token_id

    tc_path = model_dir / "tokenizer_config.json"
    eos: list[int] = []
    eos += _ids(config.get("eos_token_id"), f"{model_dir / 'config.json'}: eos_token_id")
    eos += _ids(gen_config.get("eos_token_id"),
                f"{model_dir / 'generation_config.json'}: eos_token_id")
    tc_eos = lookup(_token_content(tok_config.get("eos_token")), f"{tc_path}: eos_token")
    eos += [] if tc_eos is None else [tc_eos]
    eos_ids = tuple(dict.fromkeys(eos))
    if not eos_ids:
        raise ValueError(f"{model_dir}: eos_token_id: found in none of config.json, "
                         "generation_config.json, tokenizer_config.json")
    bad = [i for i in eos_ids if i >= max(vocab_size, model_vocab_size)]
    if bad:
        raise ValueError(f"{model_dir}: eos_token_id: {bad} outside the vocabulary")

    bos_ids = _ids(config.get("bos_token_id"), f"{model_dir / 'config.json'}: bos_token_id")
    bos_id = bos_ids[0] if bos_ids else lookup(
        _token_content(tok_config.get("bos_token")), f"{tc_path}: bos_token")

    added = tokenizer.get_added_tokens_decoder()
    special = {t.content: i for i, t in sorted(added.items()) if t.special}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = _token_content(tok_config.get(key))
        token_id = lookup(content, f"{tc_path}: {key}")
        if token_id is not None:
            special[content] = token_id

    add_bos = tok_config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # Llama-3 / Qwen style: the post-processor decides; observe it.
        add_bos = bos_id is not None and tokenizer.encode("a").ids[:1] == [bos_id]

    chat_template = tok_config.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"{tc_path}: chat_template: expected a string (named templates are "
                         "not supported)")

    vocab_type = _detect_vocab_type(spec, raw)
    prefix_space = _detect_add_prefix_space(spec, vocab_type)
    added_list = [[i, t.content, bool(t.special)] for i, t in sorted(added.items())]
    return Vocab(
        model_dir=model_dir, tokenizer=tokenizer, vocab_size=vocab_size,
        model_vocab_size=model_vocab_size, eos_token_ids=eos_ids, bos_token_id=bos_id,
        add_bos_token=add_bos, chat_template=chat_template, special_tokens=special,
        fingerprint=_fingerprint(raw, added_list, model_vocab_size, eos_ids, vocab_type,
                                 prefix_space),
        vocab_type=vocab_type, add_prefix_space=prefix_space, raw_tokens=tuple(raw),
        special_ids=frozenset(i for i, t in added.items() if t.special) | frozenset(
            special.values()))
