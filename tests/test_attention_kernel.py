"""The Triton slot attention kernel against the plain PyTorch reference and the model's SDPA path.

Runs under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it). On a CUDA machine,
`TRITON_INTERPRET=0 python -m pytest tests/test_attention_kernel.py` tests the compiled
kernel on the GPU instead, bfloat16 and CUDA-graph capture included.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_worker.runtime import attention_kernel  # noqa: E402
from gpu_worker.runtime.attention_kernel import (  # noqa: E402
    KernelConfig,
    choose_config,
    slot_attention,
)
from gpu_worker.runtime.attention_reference import slot_attention_reference  # noqa: E402
from gpu_worker.runtime.model import ForwardBatch, Transformer  # noqa: E402
from gpu_worker.runtime.model_config import ModelConfig  # noqa: E402
from gpu_worker.runtime.parallel import TPGroup  # noqa: E402

INTERPRETED = attention_kernel._is_interpreted()
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the compiled kernel needs CUDA; on the CPU set TRITON_INTERPRET=1",
                allow_module_level=True)
DEVICE = torch.device("cpu") if INTERPRETED else torch.device("cuda")
# Triton 3.9's interpreter multiplies bfloat16 operands of tl.dot as their raw uint16 storage
# (InterpreterBuilder.create_dot calls np.matmul on it), so bfloat16 is tested compiled only.
BF16_UNDER_INTERPRETER = pytest.mark.skipif(
    INTERPRETED, reason="Triton interpreter: tl.dot on bfloat16 multiplies the raw uint16 bits")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_cache(num_slots, max_len, kv_heads, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots, max_len, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return k, v


def make_query(n, heads, head_dim, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, head_dim, generator=gen).to(dtype).to(DEVICE)


def index(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def assert_matches_reference(q, k_cache, v_cache, slots, contexts, sliding_window=None):
    scale = q.shape[-1] ** -0.5
    ours = slot_attention(q, k_cache, v_cache, slots, contexts, scale=scale,
                          sliding_window=sliding_window)
    ref = slot_attention_reference(q, k_cache, v_cache, slots, contexts, scale=scale,
                                   sliding_window=sliding_window)
    assert ours.shape == q.shape and ours.dtype == q.dtype
    torch.testing.assert_close(ours.float(), ref.float(), atol=TOLERANCE[q.dtype],
                               rtol=TOLERANCE[q.dtype])
    return ours


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 7])
def test_kernel_matches_reference_for_every_gqa_group_and_head_dim(group, head_dim):
    kv_heads = 2
    k, v = make_cache(5, 64, kv_heads, head_dim, seed=group)
    q = make_query(6, kv_heads * group, head_dim)
    assert_matches_reference(q, k, v, index([3, 1, 0, 4, 2, 1]),
                             index([64, 1, 17, 33, 63, 40], torch.int32))


def test_head_dim_not_a_power_of_two_is_padded_inside_the_kernel():
    k, v = make_cache(3, 40, 2, 80)
    q = make_query(4, 4, 80)
    assert_matches_reference(q, k, v, index([2, 0, 1, 2]), index([40, 3, 39, 1]))


@pytest.mark.parametrize("dtype", [
    torch.float16, pytest.param(torch.bfloat16, marks=BF16_UNDER_INTERPRETER)])
def test_half_precision_softmax_runs_in_float32(dtype):
    k, v = make_cache(4, 64, 2, 64, dtype)
    q = make_query(5, 14, 64, dtype) * 4  # large logits: a half-precision softmax would drift
    assert_matches_reference(q, k, v, index([0, 1, 2, 3, 0]), index([64, 50, 2, 31, 9]))


def test_sliding_window_ignores_keys_older_than_the_window():
    k, v = make_cache(4, 48, 2, 64)
    q = make_query(4, 4, 64)
    slots, contexts = index([0, 1, 2, 3]), index([48, 5, 30, 9])
    ours = assert_matches_reference(q, k, v, slots, contexts, sliding_window=8)
    k2, v2 = k.clone(), v.clone()
    for slot, ctx in enumerate((48, 5, 30, 9)):
        k2[slot, :max(0, ctx - 8)] = 1e3  # only keys before each row's window change
        v2[slot, :max(0, ctx - 8)] = 1e3
    again = slot_attention(q, k2, v2, slots, contexts, scale=0.125, sliding_window=8)
    torch.testing.assert_close(again, ours)


def test_context_one_padding_rows_read_only_the_first_key_of_the_scratch_slot():
    scratch = 4
    k, v = make_cache(5, 32, 2, 64)
    q = make_query(6, 14, 64)
    slots = index([2, scratch, scratch, 0, scratch, scratch])
    contexts = index([32, 1, 1, 9, 1, 1])
    out = assert_matches_reference(q, k, v, slots, contexts)
    # One key: softmax weight 1, so a padding row's output is that key's value, exactly.
    expected = v[scratch, 0].repeat_interleave(7, dim=0)  # (H, D)
    for row in (1, 2, 4, 5):
        torch.testing.assert_close(out[row], expected, atol=1e-6, rtol=0)


def test_prefill_chunk_rows_are_causal_through_their_own_context_lengths():
    start, chunk, slot = 5, 12, 1
    k, v = make_cache(3, 32, 2, 64)
    decode_q = make_query(2, 4, 64, seed=2)
    q = torch.cat([decode_q[:1], make_query(chunk, 4, 64), decode_q[1:]])
    slots = index([0] + [slot] * chunk + [2])
    contexts = index([20] + list(range(start + 1, start + chunk + 1)) + [31])
    out = assert_matches_reference(q, k, v, slots, contexts)
    # Overwriting the chunk's later keys must not change its earlier rows.
    k2, v2 = k.clone(), v.clone()
    k2[slot, start + 4:], v2[slot, start + 4:] = 1e3, 1e3
    again = slot_attention(q, k2, v2, slots, contexts, scale=0.125)
    torch.testing.assert_close(again[:5], out[:5])  # decode row, then contexts 6..9


def test_q_may_be_a_strided_slice_of_a_fused_qkv_projection():
    n, heads, kv_heads, hd = 5, 4, 2, 64
    qkv = make_query(n, heads + 2 * kv_heads, hd).reshape(n, -1)  # (N, (H + 2 KV) * D)
    q = qkv[:, :heads * hd].view(n, heads, hd)
    assert not q.is_contiguous()
    layers = torch.randn(3, 4, 32, kv_heads, hd, device=DEVICE)  # (layers, S, L, KV, D)
    k_cache, v_cache = layers[1], layers[2]  # one layer of a bigger buffer each
    assert_matches_reference(q, k_cache, v_cache, index([0, 3, 2, 1, 3]), index([32, 4, 17, 1, 9]))


def test_cache_with_non_contiguous_slot_and_position_strides():
    k, v = make_cache(4, 32, 3, 64)
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)  # slot stride < position stride
    assert k_t.stride(0) < k_t.stride(1)
    q = make_query(3, 6, 64)
    assert_matches_reference(q, k_t, v, index([3, 0, 1]), index([32, 2, 20]))


def test_out_is_written_in_place_and_returned():
    k, v = make_cache(3, 32, 2, 64)
    q = make_query(4, 4, 64)
    slots, contexts = index([1, 0, 2, 1]), index([8, 32, 1, 30])
    buffer = torch.full((4, 8, 64), 7.0, device=DEVICE)
    out = buffer[:, 2:6]  # a strided view: only it may change
    returned = slot_attention(q, k, v, slots, contexts, scale=0.125, out=out)
    assert returned.data_ptr() == out.data_ptr()
    ref = slot_attention_reference(q, k, v, slots, contexts, scale=0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert (buffer[:, :2] == 7).all() and (buffer[:, 6:] == 7).all()


def test_rows_of_different_slots_in_any_order_get_their_own_results():
    k, v = make_cache(6, 32, 2, 64)
    q = make_query(7, 4, 64)
    slots, contexts = index([5, 0, 3, 3, 1, 4, 2]), index([32, 3, 11, 12, 1, 27, 19])
    out = assert_matches_reference(q, k, v, slots, contexts)
    order = torch.tensor([6, 2, 0, 5, 1, 4, 3], device=DEVICE)
    shuffled = slot_attention(q[order], k, v, slots[order], contexts[order], scale=0.125)
    torch.testing.assert_close(shuffled, out[order], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("splits", [2, 5])
def test_keys_split_among_programs_merge_to_the_unsplit_result(splits):
    k, v = make_cache(4, 64, 2, 64)
    q = make_query(5, 14, 64)
    slots, contexts = index([0, 1, 2, 3, 1]), index([64, 1, 17, 40, 3])  # some splits empty
    out = torch.empty_like(q)
    attention_kernel._launch(q, k, v, slots, contexts, 0.125, 64, out, 7,
                             KernelConfig(block_n=16, num_splits=splits))
    ref = slot_attention_reference(q, k, v, slots, contexts, scale=0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_out_of_range_rows_produce_zeros_instead_of_reading_outside_the_cache():
    # On a GPU the launcher cannot check index values; the kernel must stay inside the cache.
    k, v = make_cache(3, 16, 2, 64)
    q = make_query(4, 4, 64)
    slots, contexts = index([3, -1, 0, 1]), index([5, 5, 0, 16])
    for splits in (1, 3):
        out = torch.full_like(q, 7.0)
        attention_kernel._launch(q, k, v, slots, contexts, 0.125, 16, out, 2,
                                 KernelConfig(block_n=16, num_splits=splits))
        assert (out[:3] == 0).all()
        ref = slot_attention_reference(q[3:], k, v, slots[3:], contexts[3:], scale=0.125)
        torch.testing.assert_close(out[3:], ref, atol=2e-5, rtol=2e-5)


def tiny_model(sliding_window):
    config = ModelConfig(
        family="mistral" if sliding_window else "qwen2", vocab_size=32, hidden_size=64,
        num_layers=1, num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=32,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=False, attention_bias=False, sliding_window=sliding_window,
        torch_dtype="float32")
    model = Transformer(config, TPGroup(0, 1, None, DEVICE), torch.float32)
    model.allocate_kv_cache(6, 32)
    gen = torch.Generator().manual_seed(3)
    model.k_cache.copy_(torch.randn(model.k_cache.shape, generator=gen))
    model.v_cache.copy_(torch.randn(model.v_cache.shape, generator=gen))
    return model


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_kernel_equals_the_models_sdpa_attention_for_a_mixed_step(sliding_window):
    model = tiny_model(sliding_window)
    attn, k_cache, v_cache = model.layers[0].attn, model.k_cache[0], model.v_cache[0]
    # Decode rows, a first prefill chunk and a continuing one, slots out of order.
    lens = [1, 6, 1, 4, 1]
    batch = ForwardBatch.build([3, 0, 5, 1, 2], [10, 0, 6, 20, 0],
                               [[0] * n for n in lens], DEVICE)
    q = make_query(batch.num_tokens, attn.heads, attn.head_dim)
    masks = model._masks(batch)
    # What Attention.forward computes after its cache write, path by path.
    expected = torch.empty(batch.num_tokens, attn.heads * attn.head_dim, device=DEVICE)
    expected.index_copy_(0, batch.decode_token_index, attn._decode(
        q.index_select(0, batch.decode_token_index), batch, masks.decode, k_cache, v_cache))
    for (_, offset, slot, start, length), mask in zip(batch.prefill_seqs, masks.prefill,
                                                      strict=True):
        expected[offset:offset + length] = attn._prefill(
            q[offset:offset + length], k_cache[slot, :start + length],
            v_cache[slot, :start + length], mask)
    ours = slot_attention(q, k_cache, v_cache, batch.token_slots, batch.positions + 1,
                          scale=attn.scale, sliding_window=model.config.sliding_window)
    torch.testing.assert_close(ours.reshape(batch.num_tokens, -1), expected, atol=2e-5,
                               rtol=2e-5)


def good_args():
    k, v = make_cache(3, 16, 2, 64)
    return dict(q=make_query(2, 4, 64), k_cache=k, v_cache=v, token_slots=index([0, 2]),
                context_lens=index([1, 16]), scale=0.125, sliding_window=None, out=None)


def call(attend, args):
    return attend(args["q"], args["k_cache"], args["v_cache"], args["token_slots"],
                  args["context_lens"], scale=args["scale"],
                  sliding_window=args["sliding_window"], out=args["out"])


# Index values out of range: checked on the CPU only (on a GPU a check would cost a sync).
VALUE = pytest.mark.skipif(DEVICE.type != "cpu", reason="index values are checked on the CPU only")


@pytest.mark.parametrize("change, field", [
    (dict(q=torch.zeros(2, 4 * 64)), "q"),
    (dict(q=torch.zeros(2, 4, 64, dtype=torch.float64)), "q"),
    (dict(q=torch.zeros(2, 4, 40)), "q"),
    (dict(q=torch.zeros(2, 64, 4).transpose(1, 2)), "q"),
    (dict(q=torch.zeros(2, 4, 48)), "k_cache"),
    (dict(k_cache=torch.zeros(3, 16, 128)), "k_cache"),
    (dict(k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.float16)), "k_cache"),
    (dict(k_cache=torch.zeros(3, 16, 64, 2).transpose(2, 3)), "k_cache"),
    (dict(k_cache=torch.zeros(3, 16, 3, 64), v_cache=torch.zeros(3, 16, 3, 64)), "k_cache"),
    (dict(v_cache=torch.zeros(3, 8, 2, 64)), "v_cache"),
    (dict(token_slots=torch.tensor([0, 1], dtype=torch.int32)), "token_slots"),
    (dict(token_slots=torch.tensor([0])), "token_slots"),
    pytest.param(dict(token_slots=torch.tensor([0, 3])), "token_slots", marks=VALUE),
    pytest.param(dict(token_slots=torch.tensor([-1, 0])), "token_slots", marks=VALUE),
    (dict(context_lens=torch.tensor([1.0, 2.0])), "context_lens"),
    (dict(context_lens=torch.tensor([[1, 2]])), "context_lens"),
    pytest.param(dict(context_lens=torch.tensor([0, 2])), "context_lens", marks=VALUE),
    pytest.param(dict(context_lens=torch.tensor([1, 17])), "context_lens", marks=VALUE),
    (dict(scale=True), "scale"),
    (dict(scale=None), "scale"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=2.0), "sliding_window"),
    (dict(out=torch.zeros(2, 4, 32)), "out"),
    (dict(out=torch.zeros(2, 4, 64, dtype=torch.float16)), "out"),
    (dict(out=torch.zeros(2, 64, 4).transpose(1, 2)), "out"),
])
@pytest.mark.parametrize("attend", [slot_attention, slot_attention_reference])
def test_bad_arguments_raise_value_error_naming_the_argument(change, field, attend):
    args = good_args()
    args.update({name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                 for name, value in change.items()})
    with pytest.raises(ValueError, match=f"^{field}:"):
        call(attend, args)


def test_tensors_on_another_device_raise_value_error():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    args = good_args()
    args["token_slots"] = args["token_slots"].to("cpu" if DEVICE.type == "cuda" else "cuda")
    with pytest.raises(ValueError, match="^token_slots:"):
        call(slot_attention, args)


def test_cpu_tensors_without_the_interpreter_raise_a_clear_error(monkeypatch):
    monkeypatch.setattr(attention_kernel, "_is_interpreted", lambda: False)
    k, v = make_cache(2, 8, 1, 64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        slot_attention(make_query(1, 1, 64).cpu(), k.cpu(), v.cpu(), torch.tensor([0]),
                       torch.tensor([1]), scale=0.125)


def test_no_rows_returns_an_empty_result():
    k, v = make_cache(2, 8, 1, 64)
    out = slot_attention(make_query(0, 2, 64), k, v, index([]), index([]), scale=0.125)
    assert out.shape == (0, 2, 64)


def test_keys_are_split_only_when_rows_would_leave_multiprocessors_idle(monkeypatch):
    monkeypatch.setattr(attention_kernel, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert choose_config(64, 2, 1024, cuda).num_splits > 1  # 128 programs on 132 SMs
    assert choose_config(256, 4, 1024, cuda).num_splits == 1
    assert choose_config(1, 2, 128, cuda).num_splits == 1  # too few keys to share
    assert choose_config(1, 1, 1 << 20, cuda).num_splits == attention_kernel._MAX_SPLITS
    assert choose_config(1, 2, 4096, torch.device("cpu")).num_splits == 1


@pytest.mark.skipif(INTERPRETED, reason="CUDA-graph capture needs the compiled kernel on CUDA")
@pytest.mark.parametrize("n_rows", [2, 64])
def test_captured_launch_replays_with_new_slots_and_contexts(n_rows):
    k, v = make_cache(n_rows + 1, 256, 2, 64, torch.bfloat16)
    q = make_query(n_rows, 14, 64, torch.bfloat16)
    slots = index([n_rows] * n_rows)
    contexts = index([1] * n_rows)
    out = torch.empty_like(q)
    slot_attention(q, k, v, slots, contexts, scale=0.125, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slot_attention(q, k, v, slots, contexts, scale=0.125, out=out)
    gen = torch.Generator().manual_seed(5)
    slots.copy_(torch.randperm(n_rows + 1, generator=gen)[:n_rows])
    contexts.copy_(torch.randint(1, 257, (n_rows,), generator=gen))
    graph.replay()
    ref = slot_attention_reference(q, k, v, slots, contexts, scale=0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
