"""Real tokenizers of six families (tests/data/tokenizers, sources and licences in its README):
gramserve's vocabulary equals transformers' and xgrammar's, chat prompts equal
`apply_chat_template` (a Llama-3.2 template with `strftime_now` from a separate
chat_template.jinja included), and, for one tokenizer of each kind, a JSON-schema request is
compiled by the grammar service and served by a worker on a tiny random-weight model with that
tokenizer, asked through `gramserve generate --messages`, whose prompt tokens equal
transformers'."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import xgrammar as xgr
from conftest import RealSystem

from gateway.chat import chat_prompt_ids
from grammar_service.vocab import load_vocab
from protos.gateway_pb2 import ChatMessage

DATA = Path(__file__).parent / "data" / "tokenizers"
ROOT = Path(__file__).resolve().parent.parent
# family -> (transformers architecture of the tiny model, config.json extras)
FAMILIES = {
    "qwen3": ("Qwen3", dict(vocab_size=151936, eos_token_id=151645, tie_word_embeddings=True)),
    "llama3": ("Llama", dict(vocab_size=128256, bos_token_id=128000,
                             eos_token_id=[128001, 128008, 128009])),
    "gemma3": ("Llama", dict(vocab_size=262208, bos_token_id=2, eos_token_id=[1, 106])),
    "llama2": ("Mistral", dict(vocab_size=32000, bos_token_id=1, eos_token_id=2)),
    "mistral_nemo": ("Mistral", dict(vocab_size=131072, bos_token_id=1, eos_token_id=2)),
    "phi3": ("Phi3", dict(vocab_size=32064, bos_token_id=1, eos_token_id=[32000, 32007],
                          pad_token_id=32000)),
}
TEXTS = ['{"name": "José García", "age": 42, "tags": ["a", "🚀"]}',
         "Grüße aus München, 東京 and 😀 — prose.\n\tdef f(x): return x * 2"]
MESSAGES = [{"role": "system", "content": "Answer in JSON. Zoë says «bonjour»."},
            {"role": "user", "content": "A number for 東京, please."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def write_model(family: str, out: Path) -> Path:
    """A checkpoint directory: the family's tokenizer files and a tiny random model."""
    out.mkdir(parents=True)
    for src in (DATA / family).iterdir():
        if src.suffix == ".gz":
            (out / src.stem).write_bytes(gzip.decompress(src.read_bytes()))
        elif src.name != "README.md":
            shutil.copy(src, out / src.name)
    arch, extra = FAMILIES[family]
    config = getattr(transformers, f"{arch}Config")(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, max_position_embeddings=512, **extra)
    torch.manual_seed(0)
    getattr(transformers, f"{arch}ForCausalLM")(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    """(family, checkpoint dir, gramserve's Vocab, transformers' tokenizer)."""
    d = write_model(request.param, tmp_path_factory.mktemp("real") / request.param)
    return request.param, d, load_vocab(d), transformers.AutoTokenizer.from_pretrained(d)


def test_vocabulary_equals_transformers_and_xgrammar(model):
    family, d, vocab, hf = model
    assert vocab.vocab_size == len(hf)
    assert vocab.model_vocab_size == FAMILIES[family][1]["vocab_size"]
    theirs = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab.model_vocab_size,
                                                stop_token_ids=list(vocab.eos_token_ids))
    ours = vocab.tokenizer_info()
    assert (ours.vocab_type, ours.add_prefix_space) == (theirs.vocab_type,
                                                         theirs.add_prefix_space)
    assert ours.decoded_vocab == theirs.decoded_vocab
    assert ours.stop_token_ids == theirs.stop_token_ids
    for text in TEXTS:
        ids = vocab.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert vocab.encode(text) == hf.encode(text)
        assert vocab.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        # The detokeniser's bytes spell the text (SentencePiece styles add the prefix space).
        joined = b"".join(vocab.token_bytes(i) for i in ids)
        assert joined in (text.encode(), b" " + text.encode())


def test_chat_prompt_equals_apply_chat_template(model):
    family, _, vocab, hf = model
    tools_cases = [None, TOOLS] if family in ("qwen3", "llama3", "mistral_nemo") else [None]
    for tools in tools_cases:
        ours = chat_prompt_ids(vocab, [ChatMessage(**m) for m in MESSAGES], tools)
        theirs = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
        assert ours == list(theirs), (family, tools)
        text = vocab.decode(ours, skip_special_tokens=False)
        assert "東京" in text and "Zoë" in text
        if tools:
            assert "get_weather" in text
    if family == "llama3":  # the template of chat_template.jinja, with today's date
        assert "Today Date: " in text and "26 Jul 2024" not in text


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gateway.cli import main; "
                           "raise SystemExit(main())", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**__import__("os").environ,
                                                           "PYTHONPATH": str(ROOT)})


# A whole stack (grammar service, worker, gateway) takes 30-60 s to start with a large
# vocabulary on a CI machine, so it is started for one tokenizer of each kind: byte-level BPE
# (qwen3; llama3 and mistral_nemo are of this kind), SentencePiece with byte fallback and the
# largest vocabulary (gemma3), SentencePiece with added end tokens (phi3; llama2 is of this
# kind). The tests above hold for all six.
SERVED = ["qwen3", "gemma3", "phi3"]


@pytest.mark.parametrize("model", SERVED, indirect=True)
def test_json_schema_request_is_compiled_and_served_through_gramserve_generate(model, tmp_path):
    family, d, vocab, hf = model
    system = RealSystem(tmp_path, tp=1, slots=2, model=str(d))
    try:
        gateway = system.add_gateway()
        system.wait_serving(timeout=300)
        (tmp_path / "messages.json").write_text(json.dumps(MESSAGES, ensure_ascii=False))
        (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
        out = _cli("generate", "--addr", gateway, "--messages", str(tmp_path / "messages.json"),
                   "--json-schema", str(tmp_path / "schema.json"), "--whitespace", "compact",
                   "--max-tokens", "24", "--seed", "3", "--json")
        assert out.returncode == 0, out.stderr + "\n".join(c.tail() for c in system.children)
        result = json.loads(out.stdout)
        expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
        assert result["prompt_token_ids"] == list(expected)
        assert result["finish_reason"] == "FINISH_REASON_GRAMMAR_COMPLETED", result
        assert result["schema_valid"] is True and 0 <= json.loads(result["text"])["n"] <= 9
    finally:
        system.stop()
