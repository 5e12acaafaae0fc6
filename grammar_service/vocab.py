"""The model's vocabulary: tokenizer, special ids, fingerprint and xgrammar's view of it.

The tokenizer is transformers' `AutoTokenizer` over the checkpoint directory (tokenizer.json,
tokenizer_config.json, a separate chat_template.jinja when there is one), always the fast
(Rust) tokenizer; xgrammar's view of it is `TokenizerInfo.from_huggingface`, so the byte
spelling of every token is the library's, not ours. What stays here is the project's own:
the model's (padded) vocabulary size from config.json, the EOS ids gathered from every file
that names them, and the fingerprint. The fingerprint names the vocabulary a compiled
grammar belongs to: a grammar compiled against one fingerprint must never drive a model with
another.

transformers is imported when a vocabulary is loaded, not when this module is: the compile
subprocesses build their backends from a `VocabView` and never pay for it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xgrammar as xgr


@dataclass(frozen=True, eq=False)
class Vocab:
    """A model's vocabulary as loaded by `load_vocab`. Immutable; safe to share between threads.

    `tokenizer` is the transformers fast tokenizer of the checkpoint. `vocab_size` counts the
    tokenizer's ids (added tokens included); `model_vocab_size` is the model's
    embedding/LM-head size, which may be larger (padded ids that no text maps to).
    `chat_template` is the template transformers found (tokenizer_config.json or
    chat_template.jinja), None when there is none.
    """

    model_dir: Path
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    vocab_size: int
    model_vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    special_tokens: dict[str, int]
    special_ids: frozenset[int]
    info: xgr.TokenizerInfo = field(repr=False)
    fingerprint: str
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def vocab_type(self) -> xgr.VocabType:
        """How the vocabulary spells bytes, as xgrammar detected it."""
        return self.info.vocab_type

    @property
    def add_prefix_space(self) -> bool:
        """Whether tokenisation prepends a space (SentencePiece style), as xgrammar detected it."""
        return self.info.add_prefix_space

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        """xgrammar's TokenizerInfo for this vocabulary (built once, at load).

        The token mask has `model_vocab_size` entries; padded ids decode to nothing, so no
        grammar ever allows them. Stop tokens are `eos_token_ids`.
        """
        return self.info

    def tokenizer_json(self) -> str:
        """The fast tokenizer's own JSON (what llguidance reads), built once then cached."""
        with self._lock:
            text = self._cache.get("tokenizer_json")
            if text is None:
                text = self._cache["tokenizer_json"] = self.tokenizer.backend_tokenizer.to_str()
            return text

    def llguidance_tokenizer(self):
        """llguidance's LLTokenizer for this vocabulary, built once and then cached: the same
        fast tokenizer, `model_vocab_size` ids (as tokenizer_info) and `eos_token_ids`."""
        text = self.tokenizer_json()
        with self._lock:
            tok = self._cache.get("llguidance_tokenizer")
            if tok is None:
                from grammar_service.backends import llguidance_tokenizer

                tok = llguidance_tokenizer(text, self.model_vocab_size, self.eos_token_ids)
                self._cache["llguidance_tokenizer"] = tok
            return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer adds what it adds
        (BOS for the default model). No state changes."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Padded ids (>= vocab_size) are dropped; special tokens are dropped
        unless `skip_special_tokens` is False."""
        kept = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids of `messages` (and `tools`, for templates that render them) rendered by
        the checkpoint's chat template with the generation prompt appended, exactly as
        transformers' `apply_chat_template` gives them. Raises ValueError when the model has
        no chat template and jinja2.TemplateError when the template refuses the messages."""
        if self.chat_template is None:
            raise ValueError("the model has no chat template")
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, add_generation_prompt=True,
            tokenize=False)
        # The rendered text holds the BOS the template writes; the tokenizer must not add one.
        return self.encode(text, add_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for, for incremental detokenisation: xgrammar's
        decoded vocabulary, with b"" for special tokens and padded ids.

        Raises ValueError for an id outside [0, max(vocab_size, model_vocab_size)).
        """
        limit = max(self.vocab_size, self.model_vocab_size)
        if not 0 <= token_id < limit:
            raise ValueError(f"token_id: {token_id} is outside [0, {limit})")
        table = self._cache.get("token_bytes")
        if table is None:
            with self._lock:
                table = self._cache.get("token_bytes")
                if table is None:
                    decoded = self.info.decoded_vocab
                    table = tuple(b"" if i in self.special_ids else decoded[i]
                                  for i in range(min(len(decoded), self.vocab_size)))
                    self._cache["token_bytes"] = table
        return table[token_id] if token_id < len(table) else b""


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


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: expected a non-negative int or a list of them, got {value!r}")
    return list(values)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _fingerprint(info: xgr.TokenizerInfo, added: list[list[Any]]) -> str:
    # xgrammar's serialized TokenizerInfo holds every token's bytes, the vocabulary type,
    # prefix-space rule, padded size and stop ids: all a compiled grammar depends on.
    digest = hashlib.sha256()
    digest.update(info.serialize_json().encode())
    digest.update(json.dumps(added, ensure_ascii=False, separators=(",", ":")).encode())
    return digest.hexdigest()


def load_tokenizer(model_dir: str | Path):
    """transformers' fast tokenizer of the checkpoint in `model_dir`, read from local files
    only. Raises ValueError naming the directory when there is none or it is not a fast
    (tokenizer.json backed) tokenizer."""
    import transformers

    model_dir = Path(model_dir)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers and the Rust side raise many kinds
        raise ValueError(f"{model_dir / 'tokenizer.json'}: not a tokenizer: {exc}") from exc
    if not getattr(tok, "is_fast", False) or not hasattr(tok, "backend_tokenizer"):
        raise ValueError(f"{model_dir}: needs a fast tokenizer (tokenizer.json)")
    return tok


def load_vocab(model_dir: str | Path) -> Vocab:
    """Load the vocabulary of the Hugging Face checkpoint in `model_dir`.

    Reads the tokenizer with transformers (tokenizer.json required), config.json (required:
    "vocab_size") and generation_config.json when present. EOS ids are the union, in that
    order, of config.json's eos_token_id, generation_config.json's eos_token_id and the
    tokenizer's eos token. Raises ValueError naming the missing or bad file or key (no EOS id
    anywhere is an error).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: not a directory")
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir / 'tokenizer.json'}: missing (required in a model directory)")
    config = _read_json(model_dir / "config.json", required=True)
    tc_path = model_dir / "tokenizer_config.json"
    tok_config = _read_json(tc_path, required=False) or {}
    gen_config = _read_json(model_dir / "generation_config.json", required=False) or {}
    model_vocab_size = config.get("vocab_size")
    if not isinstance(model_vocab_size, int) or isinstance(model_vocab_size, bool) \
            or model_vocab_size <= 0:
        raise ValueError(f"{model_dir / 'config.json'}: vocab_size: expected a positive int, "
                         f"got {model_vocab_size!r}")
    tok = load_tokenizer(model_dir)
    _check_named_tokens(model_dir, tok, tok_config)

    token_to_id = tok.get_vocab()
    vocab_size = max(len(token_to_id), max(token_to_id.values(), default=-1) + 1)
    eos: list[int] = []
    eos += _ids(config.get("eos_token_id"), f"{model_dir / 'config.json'}: eos_token_id")
    eos += _ids(gen_config.get("eos_token_id"),
                f"{model_dir / 'generation_config.json'}: eos_token_id")
    eos += [] if tok.eos_token_id is None else [tok.eos_token_id]
    eos_ids = tuple(dict.fromkeys(eos))
    if not eos_ids:
        raise ValueError(f"{model_dir}: eos_token_id: found in none of config.json, "
                         "generation_config.json, tokenizer_config.json")
    bad = [i for i in eos_ids if i >= max(vocab_size, model_vocab_size)]
    if bad:
        raise ValueError(f"{model_dir}: eos_token_id: {bad} outside the vocabulary")
    bos_ids = _ids(config.get("bos_token_id"), f"{model_dir / 'config.json'}: bos_token_id")
    bos_id = bos_ids[0] if bos_ids else tok.bos_token_id

    added = tok.added_tokens_decoder  # {id: AddedToken}
    special = {t.content: i for i, t in sorted(added.items()) if t.special}
    special.update({t: i for t, i in zip(tok.all_special_tokens, tok.all_special_ids,
                                         strict=True)})
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model_vocab_size,
                                              stop_token_ids=list(eos_ids))
    template = tok.chat_template
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{tc_path}: chat_template: expected a string (named templates are "
                         "not supported)")
    added_list = [[i, t.content, bool(t.special)] for i, t in sorted(added.items())]
    return Vocab(
        model_dir=model_dir, tokenizer=tok, vocab_size=vocab_size,
        model_vocab_size=model_vocab_size, eos_token_ids=eos_ids, bos_token_id=bos_id,
        add_bos_token=bos_id is not None and tok.encode("a")[:1] == [bos_id],
        chat_template=template, special_tokens=special,
        special_ids=frozenset(special.values()), info=info,
        fingerprint=_fingerprint(info, added_list))


def _check_named_tokens(model_dir: Path, tok, tok_config: dict[str, Any]) -> None:
    """Refuse a bos/eos token that tokenizer_config.json names but tokenizer.json lacks:
    transformers would silently append it as a new token no model was trained on."""
    base = tok.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    raw = None
    for key in ("bos_token", "eos_token"):
        content = _token_content(tok_config.get(key))
        token_id = None if content is None else tok.convert_tokens_to_ids(content)
        if token_id is None or token_id < base:
            continue
        if raw is None:  # an added token: it must be one of tokenizer.json's
            raw = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
        if json.dumps(content, ensure_ascii=False) not in raw:
            raise ValueError(f"{model_dir / 'tokenizer_config.json'}: {key}: token "
                             f"{content!r} is not in tokenizer.json")
