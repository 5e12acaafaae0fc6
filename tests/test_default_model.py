"""The embedded default model: deterministic bytes, a real Llama checkpoint, a padded vocab."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from grammar_service import default_model
from grammar_service.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_VERSION,
    ensure_default_model,
    resolve_model,
)
from grammar_service.vocab import load_vocab

REPO = Path(__file__).resolve().parents[1]

# Pinned so that any change to the generated model is noticed; when the change is meant,
# bump DEFAULT_MODEL_VERSION and update both. (The fingerprint also changes when its
# definition does: it hashes xgrammar's serialized TokenizerInfo, see grammar_service/vocab.py.)
MODEL_SAFETENSORS_SHA256 = "c466301d62da6e44d42f82602ba942c2f76512bc857d9d87b79bbbb09a6a8eea"
VOCAB_FINGERPRINT = "f5a2a2146fd11b19d9180b4b50585378f71a74ee1f86e5b208c0392b4abf47ce"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir())}


def test_default_model_bytes_identical_across_fresh_dirs_and_processes(model_dir, tmp_path):
    # A second process has a different hash seed (Python and the tokenizer's Rust maps).
    script = ("import sys; from pathlib import Path; "
              "from grammar_service.default_model import ensure_default_model; "
              "print(ensure_default_model(Path(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, check=True)
    other = Path(out.stdout.strip())
    assert other != model_dir
    assert _digests(other) == _digests(model_dir)
    assert set(_digests(model_dir)) == {"config.json", "generation_config.json",
                                        "model.safetensors", "tokenizer.json",
                                        "tokenizer_config.json"}


def test_default_model_fingerprints_are_pinned(model_dir):
    digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    assert digest == MODEL_SAFETENSORS_SHA256
    assert load_vocab(model_dir).fingerprint == VOCAB_FINGERPRINT


def test_default_model_dir_is_versioned_under_model_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAMSERVE_MODEL_CACHE", str(tmp_path))
    expected = tmp_path / f"{DEFAULT_MODEL_NAME}-v{DEFAULT_MODEL_VERSION}"
    assert default_model.default_model_dir() == expected
    assert not expected.exists()  # asking where it lives creates nothing


def test_transformers_loads_default_model_with_every_tensor_and_finite_logits(model_dir):
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    vocab = load_vocab(model_dir)
    ids = vocab.encode('{"name": "Zoë", "items": [1, 2, 3]} and some prose.')
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # (seq, model_vocab)
    assert logits.shape == (len(ids), vocab.model_vocab_size)
    assert torch.isfinite(logits).all()
    real = logits[:, : vocab.vocab_size]
    # Logit spread of ~5 gives greedy decoding clear gaps (robust to fp32 reduction order).
    assert 4.0 < float(real.std(dim=-1).mean()) < 6.0
    top2 = real.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3


def test_default_model_has_padded_vocab_with_zero_rows(model_dir):
    vocab = load_vocab(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert vocab.vocab_size == 4000
    assert config["vocab_size"] == vocab.model_vocab_size == 4032
    assert vocab.model_vocab_size % 64 == 0 and vocab.model_vocab_size > vocab.vocab_size
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        assert tensors[name].shape == (4032, 64)
        assert not tensors[name][vocab.vocab_size:].any()
        assert tensors[name][: vocab.vocab_size].any(axis=1).all()
    assert 0.5 < float(np.std(tensors["lm_head.weight"][:4000])) < 0.75
    assert 0.015 < float(np.std(tensors["model.layers.0.mlp.up_proj.weight"])) < 0.025


def test_default_model_special_tokens_and_chat_template(model_dir):
    vocab = load_vocab(model_dir)
    assert vocab.add_bos_token and vocab.encode("hi")[0] == vocab.bos_token_id
    assert vocab.encode("hi", add_special_tokens=False)[0] != vocab.bos_token_id
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(vocab.special_tokens)
    assert vocab.eos_token_ids == (vocab.special_tokens["<|endoftext|>"],
                                   vocab.special_tokens["<|im_end|>"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = jinja2.Template(vocab.chat_template).render(
        messages=messages, add_generation_prompt=True, bos_token="<|begin_of_text|>")
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = vocab.encode(text, add_special_tokens=False)
    assert ids.count(vocab.special_tokens["<|im_start|>"]) == 3
    assert ids[0] == vocab.bos_token_id

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert hf.encode(text, add_special_tokens=False) == ids


def test_concurrent_ensure_default_model_yields_one_complete_dir(tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []

    def build():
        try:
            results.append(ensure_default_model(tmp_path))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    # Only the model directory is left: no temporary build directory lingers.
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    digest = hashlib.sha256((results[0] / "model.safetensors").read_bytes()).hexdigest()
    assert digest == MODEL_SAFETENSORS_SHA256


def test_resolve_model_default_and_bad_paths(monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("GRAMSERVE_MODEL_CACHE", str(model_dir.parent))
    assert resolve_model(None) == model_dir
    assert resolve_model("") == model_dir
    assert resolve_model(DEFAULT_MODEL_NAME) == model_dir
    assert resolve_model(str(model_dir)) == model_dir
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        resolve_model(str(tmp_path))


def _fake_hf_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """The layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<commit>}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    return snapshot


def test_model_given_as_repo_id_resolves_from_the_local_hf_cache(model_dir, tmp_path,
                                                                  monkeypatch):
    snapshot = _fake_hf_cache(tmp_path / "hub", "acme/tiny-llama", model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
    assert default_model.resolve_model("acme/tiny-llama") == snapshot
    assert load_vocab(snapshot).fingerprint == VOCAB_FINGERPRINT
    with pytest.raises(ValueError, match="'acme/absent' is neither a directory nor a Hugging "
                                         "Face repo in the local cache"):
        default_model.resolve_model("acme/absent")
