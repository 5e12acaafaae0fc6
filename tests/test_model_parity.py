"""Logit parity with transformers on the same weights, at TP=1 and TP=2 (real gloo, 2 processes).

Every config runs one plan of engine steps against a 5-slot cache: a full-prompt prefill, a
prefill in two chunks, three prefills in one step, decode steps batched across 3 slots of
different lengths (in a slot order that is not sorted), a step mixing decodes with a prefill
chunk, and a reused slot whose stale cache contents must not be read. Each step's logits must
match transformers' logits for the same token sequence at the same position.
"""

from __future__ import annotations

import multiprocessing
import queue
from pathlib import Path

import pytest
import torch
from procs import free_port

# name -> (transformers class name, config kwargs, save kwargs)
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               vocab_size=256, initializer_range=0.2, max_position_embeddings=64)
CONFIGS = {
    "llama": ("Llama", dict(num_key_value_heads=4), {}),
    "qwen2_bias_tied": ("Qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True), {}),
    "mistral_gqa_window": ("Mistral", dict(num_key_value_heads=2, sliding_window=6), {}),
    "llama_padded_vocab": ("Llama", dict(num_key_value_heads=2, vocab_size=131), {}),
    "llama_rope_llama3": ("Llama", dict(num_key_value_heads=2, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), {}),
    # q/k RMSNorm per head before RoPE; head_dim (32) is not hidden_size / heads (16).
    "qwen3_qk_norm_head_dim": ("Qwen3", dict(num_key_value_heads=2, head_dim=32,
                                             tie_word_embeddings=True), {}),
    # Fused qkv_proj / gate_up_proj in the checkpoint, a sliding window, half-rotary heads.
    "phi3_fused_window_partial_rope": ("Phi3", dict(
        num_key_value_heads=2, sliding_window=6, pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
        {}),
    "phi3_mha": ("Phi3", dict(num_key_value_heads=4, pad_token_id=0), {}),
    # Saved in several files, so the sharded index path is exercised too.
    "qwen2_rope_yarn_sharded": ("Qwen2", dict(num_key_value_heads=2, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
        dict(max_shard_size="60KB")),
}
TOKEN_IDS = 100  # every id used is below this, so padded vocab rows are never looked up
SEQ_LENS = {"A": 13, "B": 17, "C0": 10, "C1": 18, "C2": 12, "D": 7}
SLOT_OF = {"A": 3, "B": 4, "C0": 0, "C1": 1, "C2": 2, "D": 3}  # D reuses A's slot
# Each step: (sequence, start, end) per scheduled sequence; tokens [start, end) are new.
PLAN = [
    [("A", 0, 13)],  # full prompt
    [("B", 0, 9)], [("B", 9, 17)],  # chunked prefill
    [("C0", 0, 5), ("C1", 0, 11), ("C2", 0, 7)],  # three prefills in one step
    [("C2", 7, 8), ("C0", 5, 6), ("C1", 11, 12)],  # batched decode
    [("C2", 8, 9), ("C0", 6, 7), ("C1", 12, 13)],
    [("C0", 7, 8), ("C1", 13, 14), ("C2", 9, 10)],  # consecutive slots: a cache view
    [("C0", 8, 9), ("C1", 14, 17), ("C2", 10, 11)],  # decodes mixed with a prefill chunk
    [("C0", 9, 10), ("C1", 17, 18), ("C2", 11, 12), ("D", 0, 6)],  # slot 3 reused from 0
    [("D", 6, 7)],
]
NUM_SLOTS, MAX_LEN = 5, 32


def _sequences() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return {name: torch.randint(0, TOKEN_IDS, (n,), generator=gen).tolist()
            for name, n in SEQ_LENS.items()}


def run_plan(model_dir: str, tp) -> list[torch.Tensor]:
    """Load `model_dir` on this rank and return the (S, vocab) logits of every PLAN step."""
    from gpu_worker.runtime.loader import load_model
    from gpu_worker.runtime.model import ForwardBatch

    model = load_model(model_dir, tp, torch.float32, tp.device)
    model.allocate_kv_cache(NUM_SLOTS, MAX_LEN)
    seqs = _sequences()
    outputs = []
    for step in PLAN:
        batch = ForwardBatch.build(
            [SLOT_OF[name] for name, _, _ in step], [start for _, start, _ in step],
            [seqs[name][start:end] for name, start, end in step], tp.device)
        outputs.append(model(batch))
    return outputs


def _tp2_rank(rank: int, port: int, model_dirs: dict[str, str], results) -> None:
    torch.set_num_threads(1)
    from gpu_worker.runtime.parallel import init_distributed

    try:
        tp, _ = init_distributed(rank, 2, f"127.0.0.1:{port}", torch.device("cpu"), 60.0)
        # numpy, not tensors: a tensor crosses a Queue as a shared-memory handle that dies
        # with this process
        results.put((rank, {name: [o.numpy() for o in run_plan(d, tp)]
                            for name, d in model_dirs.items()}))
    except BaseException as exc:  # report instead of leaving the parent waiting
        results.put((rank, repr(exc)))
        raise


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """name -> (checkpoint dir, transformers logits (len, vocab) per sequence)."""
    import transformers

    seqs = _sequences()
    out = {}
    for name, (family, kwargs, save_kwargs) in CONFIGS.items():
        config = getattr(transformers, f"{family}Config")(**{**_COMMON, **kwargs})
        torch.manual_seed(0)
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True, **save_kwargs)
        with torch.no_grad():
            ref = {s: model(torch.tensor([ids])).logits[0].float() for s, ids in seqs.items()}
        out[name] = (str(path), ref)
    sharded = Path(out["qwen2_rope_yarn_sharded"][0])
    assert (sharded / "model.safetensors.index.json").exists(), "checkpoint was not sharded"
    return out


def _assert_plan_matches(name: str, outputs: list[torch.Tensor], ref: dict[str, torch.Tensor]):
    vocab = next(iter(ref.values())).shape[-1]
    for step, logits in zip(PLAN, outputs, strict=True):
        assert logits.shape == (len(step), vocab) and logits.dtype == torch.float32
        for row, (seq, _, end) in enumerate(step):
            expected = ref[seq][end - 1]
            atol = 1e-4 * max(1.0, expected.abs().max().item())
            err = (logits[row] - expected).abs().max().item()
            assert err <= atol, f"{name}: step {step}, {seq}[{end - 1}]: max error {err} > {atol}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_logits_match_transformers_at_tp1(checkpoints, name):
    from gpu_worker.runtime.parallel import TPGroup

    model_dir, ref = checkpoints[name]
    outputs = run_plan(model_dir, TPGroup(0, 1, None, torch.device("cpu")))
    _assert_plan_matches(name, outputs, ref)


def test_model_logits_match_transformers_and_agree_across_ranks_at_tp2(checkpoints):
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    dirs = {name: d for name, (d, _) in checkpoints.items()}
    procs = [ctx.Process(target=_tp2_rank, args=(r, port, dirs, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, value = results.get(timeout=120)
            assert not isinstance(value, str), f"rank {rank} failed: {value}"
            got[rank] = {name: [torch.from_numpy(o) for o in outs] for name, outs in value.items()}
    except queue.Empty:
        pytest.fail("a TP=2 rank produced no result within 120 s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for name, (_, ref) in checkpoints.items():
        _assert_plan_matches(name, got[0][name], ref)
        for step, a, b in zip(PLAN, got[0][name], got[1][name], strict=True):
            assert torch.equal(a, b), f"{name}: ranks disagree on the logits of step {step}"
