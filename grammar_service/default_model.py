"""The embedded default model: a tiny Llama checkpoint generated offline, the same everywhere.

`ensure_default_model()` writes, once, into a cache directory and in the standard Hugging
Face layout (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json), so it goes through the same loaders as a real checkpoint. Its text
is meaningless; its structure is guaranteed: a byte-level BPE vocabulary of 4000 tokens
(trained on grammar_service/data/corpus.txt plus generated JSON and prose), a padded model
vocabulary, and random weights whose bytes depend on nothing but this file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from protos.rpc import env_default

DEFAULT_MODEL_NAME = "gramserve-tiny-llama"
# Bump whenever anything below changes the generated files.
DEFAULT_MODEL_VERSION = 1

TOKENIZER_SIZE = 4000  # trained tokens + special tokens
PAD_MULTIPLE = 64  # the model's vocabulary is padded up to a multiple of this
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
IM_START, IM_END, PAD_TOKEN = "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, IM_START, IM_END, PAD_TOKEN)

# The rendered prompt starts with BOS, so encode it with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 192
HEAD_DIM = HIDDEN // HEADS
INIT_STD = 0.02
# After the final RMSNorm each hidden vector has RMS 1, so a logit's std is
# sqrt(HIDDEN) * LM_HEAD_STD = 8 * 0.625 = 5: clear gaps between the top tokens, far above
# fp32 reduction-order noise across tensor-parallel sizes.
LM_HEAD_STD = 5.0 / HIDDEN**0.5
SEED = 20240611

_DATA = Path(__file__).with_name("data") / "corpus.txt"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "generation_config.json")


def default_model_dir() -> Path:
    """Where the default model lives: $GRAMSERVE_MODEL_CACHE (else ~/.cache/gramserve/models)
    / gramserve-tiny-llama-v<version>. Creates nothing."""
    root = env_default("model_cache", None)
    root = Path(root) if root else Path.home() / ".cache" / "gramserve" / "models"
    return root / f"{DEFAULT_MODEL_NAME}-v{DEFAULT_MODEL_VERSION}"


def ensure_default_model(root: Path | None = None) -> Path:
    """Return the default model's directory, generating it first if it does not exist.

    `root` is the cache directory holding versioned model directories (default: the parent
    of `default_model_dir()`). The model is built in a temporary directory beside it and
    renamed into place, so a reader never sees a half-written model and concurrent callers
    (threads or processes) all end up with the same complete directory. Takes about a
    second. Raises OSError when the cache directory is not writable.
    """
    target = default_model_dir() if root is None else (
        Path(root) / f"{DEFAULT_MODEL_NAME}-v{DEFAULT_MODEL_VERSION}")
    if all((target / name).is_file() for name in _FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_default_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another writer won the race (its directory is complete: it was renamed whole).
            if not all((target / name).is_file() for name in _FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str | None) -> Path:
    """The checkpoint directory for a `--model` value.

    None, "" or DEFAULT_MODEL_NAME mean the embedded default model (generated on first use);
    a directory is used as it is; anything else of the form `owner/name` is a Hugging Face
    repo id, resolved to its snapshot in the local Hugging Face cache (`HF_HUB_CACHE`, else
    huggingface_hub's default; never downloaded). The directory must hold config.json and
    tokenizer.json. Raises ValueError naming the path or repo and what is missing.
    """
    if not model or model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.is_dir() and _looks_like_repo_id(model):
        path = _from_hf_cache(model)
    if not path.is_dir():
        raise ValueError(f"model: {model!r} is not a directory")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if missing:
        raise ValueError(f"model: {model!r} lacks {', '.join(missing)}")
    return path


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def _from_hf_cache(repo_id: str) -> Path:
    """The snapshot directory of `repo_id` in the local Hugging Face cache (its `main` ref).
    Raises ValueError when the repo is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None))
    except (LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"model: {repo_id!r} is neither a directory nor a Hugging Face repo "
                         f"in the local cache (download it first, e.g. `hf download "
                         f"{repo_id}`): {exc}") from None


def write_default_model(out_dir: Path) -> None:
    """Write every file of the default model into the existing directory `out_dir`."""
    tokenizer = train_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    model_vocab = -(-vocab_size // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    _write_json(out_dir / "config.json", _config(model_vocab, ids))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]],
        "pad_token_id": ids[PAD_TOKEN], "do_sample": False})
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "add_bos_token": True,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE})
    write_safetensors(out_dir / "model.safetensors", model_weights(model_vocab, vocab_size))


def _config(model_vocab: int, ids: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "initializer_range": INIT_STD, "vocab_size": model_vocab,
        "bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN], "torch_dtype": "float32",
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


# ---------------------------------------------------------------- deterministic randomness

_MASK = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 counters (wrapping arithmetic): a counter-based
    generator whose output depends only on the counter, on any machine and numpy version."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _normal(name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Approximately normal float32 values keyed by (SEED, tensor name), bit-identical
    everywhere: each value is a sum of 12 uniform 16-bit integers (Irwin-Hall), computed in
    exact integer arithmetic, centred, scaled by a power of two, then by `std` (one IEEE
    float64 multiply) and rounded to float32. No libm call, so no platform differences."""
    key = int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "little")
    n = int(np.prod(shape))
    with np.errstate(over="ignore"):
        counters = np.arange(3 * n, dtype=np.uint64) + np.uint64(key)
        bits = _splitmix64(counters).reshape(n, 3)
    parts = [(bits >> np.uint64(s)) & np.uint64(0xFFFF) for s in (0, 16, 32, 48)]
    sums = sum(p.sum(axis=1) for p in parts).astype(np.int64)  # (n,) in [0, 12 * 65535]
    # Irwin-Hall of 12 U(0, 65536): mean 12 * 65535 / 2, std ~65536.
    unit = (sums * 2 - 12 * 65535).astype(np.float64) / 131072.0
    return (unit * std).astype(np.float32).reshape(shape)


def model_weights(model_vocab: int, vocab_size: int) -> dict[str, np.ndarray]:
    """Every tensor of LlamaForCausalLM, named and shaped as transformers expects.

    Padded vocabulary rows (ids >= vocab_size) are zero in the embedding and the LM head: no
    text maps to them, and a zero logit (vs. a spread of 5) is practically never the argmax.
    """
    w: dict[str, np.ndarray] = {}
    embed = _normal("model.embed_tokens.weight", (model_vocab, HIDDEN), INIT_STD)
    embed[vocab_size:] = 0.0
    w["model.embed_tokens.weight"] = embed
    kv = KV_HEADS * HEAD_DIM
    shapes = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (kv, HIDDEN),
              "self_attn.v_proj": (kv, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
              "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTERMEDIATE)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        for part, shape in shapes.items():
            name = f"{prefix}{part}.weight"
            w[name] = _normal(name, shape, INIT_STD)
        w[prefix + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        w[prefix + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    w["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    head = _normal("lm_head.weight", (model_vocab, HIDDEN), LM_HEAD_STD)
    head[vocab_size:] = 0.0
    w["lm_head.weight"] = head
    return w


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 `tensors` in the safetensors format (8-byte header length, JSON header,
    raw little-endian data), tensors in name order. Written here rather than with the
    safetensors package so the bytes cannot change with that package's version."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        assert t.dtype == np.float32, name
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name], dtype="<f4").tobytes())


# ---------------------------------------------------------------- tokenizer and its corpus

def train_tokenizer() -> tokenizers.Tokenizer:
    """Train the default byte-level BPE tokenizer (GPT-2 / Llama-3 style, BOS prepended by
    the post-processor, special tokens at the end of the vocabulary). Deterministic: BPE
    merges are chosen by count with ties broken by pair id."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    bos = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos)])
    if tok.get_vocab_size(with_added_tokens=True) != TOKENIZER_SIZE:
        raise RuntimeError("default tokenizer: the corpus is too small for the vocabulary")
    return tok


class _Stream:
    """Deterministic choices from SplitMix64 over a counter (pure Python integers)."""

    def __init__(self, seed: int):
        self.counter = seed

    def next(self) -> int:
        self.counter = (self.counter + 0x9E3779B97F4A7C15) & _MASK
        z = self.counter
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, items):
        return items[self.below(len(items))]


_KEYS = ("id", "name", "type", "value", "count", "price", "total", "items", "user", "email",
         "address", "city", "country", "zip", "phone", "status", "created_at", "updated_at",
         "tags", "description", "title", "enabled", "score", "rating", "age", "first_name",
         "last_name", "quantity", "currency", "language", "version", "url", "data", "result",
         "error", "message", "code", "latitude", "longitude", "width", "height", "color",
         "options", "metadata", "children", "parent", "level", "priority", "date", "amount")
_WORDS = ("alpha", "beta", "gamma", "delta", "active", "pending", "shipped", "cancelled",
          "London", "Paris", "Berlin", "Tokyo", "New York", "São Paulo", "Zürich", "Kraków",
          "red", "green", "blue", "small", "large", "book", "coffee", "laptop", "garden",
          "José García", "Ana Müller", "李雷", "田中太郎", "Olivia Smith", "Noah Brown",
          "café", "naïve", "crème", "🚀 launch", "✅ done", "hello world", "EUR", "USD", "JPY",
          "en", "fr", "de", "zh", "ja", "https://example.com/a/b", "user@example.org")
_NOUNS = ("model", "server", "request", "river", "city", "engineer", "letter", "window",
          "grammar", "token", "schema", "garden", "teacher", "market", "bridge", "computer")
_VERBS = ("reads", "writes", "opens", "builds", "follows", "checks", "answers", "sends",
          "carries", "finds", "keeps", "returns", "explains", "measures")
_ADJS = ("quick", "quiet", "small", "large", "careful", "bright", "old", "new", "simple",
         "clear", "strict", "valid", "empty", "long")


def _json_value(s: _Stream, depth: int):
    kind = s.below(9 if depth < 3 else 6)
    if kind == 0:
        return s.below(2000) - 100
    if kind == 1:
        return round((s.below(2_000_000) - 1_000_000) / 1000, s.below(4))
    if kind in (2, 3):
        return s.pick(_WORDS)
    if kind == 4:
        return s.below(2) == 0
    if kind == 5:
        return None
    if kind in (6, 7):
        return {s.pick(_KEYS): _json_value(s, depth + 1) for _ in range(1 + s.below(5))}
    return [_json_value(s, depth + 1) for _ in range(s.below(5))]


def training_corpus() -> Iterator[str]:
    """The tokenizer's training text: the shipped corpus (prose, code, many scripts and
    emoji), generated JSON documents in several layouts, and generated prose."""
    shipped = _DATA.read_text(encoding="utf-8")
    for _ in range(8):
        yield shipped
    s = _Stream(SEED)
    for i in range(6000):
        doc = {s.pick(_KEYS): _json_value(s, 0) for _ in range(2 + s.below(7))}
        layout = i % 3
        if layout == 0:
            yield json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
        elif layout == 1:
            yield json.dumps(doc, ensure_ascii=False)
        else:
            yield json.dumps(doc, ensure_ascii=False, indent=2)
    for _ in range(4000):
        words = [f"The {s.pick(_ADJS)} {s.pick(_NOUNS)} {s.pick(_VERBS)} the",
                 f"{s.pick(_NOUNS)}, and a {s.pick(_ADJS)} {s.pick(_NOUNS)}",
                 f"{s.pick(_VERBS)} it {1 + s.below(99)} times."]
        yield " ".join(words)
