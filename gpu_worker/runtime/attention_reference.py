"""Plain PyTorch reference for slot attention, and the argument checks: the spec of the kernel.

Slot attention is one attention call over all N new tokens of a step, decode rows and prefill
chunks alike. Query row i belongs to slot `token_slots[i]`, whose K/V (this step's included)
are already in the cache; it attends to keys j of that slot with

    max(0, ctx_i - sliding_window) <= j < ctx_i      (0 <= j < ctx_i without a window)

where ctx_i = `context_lens[i]` is the row's position + 1. Causality inside a prefill chunk
follows from each row's own context length. GQA: query head h reads KV head h // G, with
G = H // KV query heads per KV head (transformers' repeat_kv order). Softmax runs in float32;
the output has q's dtype. The Triton kernel in `attention_kernel` must match
`slot_attention_reference` to rounding; the tests compare the two.
"""

from __future__ import annotations

import torch
from torch import Tensor

ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CONTEXT_DTYPES = (torch.int32, torch.int64)


def check_attention_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, token_slots: Tensor,
                         context_lens: Tensor, scale: float, sliding_window: int | None,
                         out: Tensor | None) -> int:
    """Validate the arguments of a slot attention call and return G (query heads per KV head).

    Shapes: q (N, H, D), k_cache and v_cache (S, L, KV, D), token_slots (N,) int64,
    context_lens (N,) int32 or int64, out None or like q. D must be a multiple of 16 and
    H a multiple of KV. Every tensor's last dimension must be contiguous; other strides are
    free (q may be a view into a fused projection, the caches one layer of a bigger buffer).
    Index values are checked only on the CPU (slots in [0, S), contexts in [1, L]): on a GPU
    that would cost a device sync.

    Raises ValueError naming the offending argument. Changes nothing.
    """
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError("q: expected a 3-D tensor (tokens, heads, head_dim)")
    if q.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} not supported; use float32, bfloat16 or float16")
    n, heads, dim = q.shape
    if dim % 16 or dim == 0:
        raise ValueError(f"q: head_dim must be a positive multiple of 16, got {dim}")
    if q.stride(2) != 1:
        raise ValueError("q: the last dimension must be contiguous (stride 1)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, Tensor) or cache.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (slots, max_len, kv_heads, head_dim)")
        if cache.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {cache.dtype}, but q is {q.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name}: on {cache.device}, but q is on {q.device}")
        if cache.stride(3) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride 1)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's "
                         f"{tuple(k_cache.shape)}")
    num_slots, max_len, kv_heads, cache_dim = k_cache.shape
    if cache_dim != dim:
        raise ValueError(f"k_cache: head_dim {cache_dim}, but q has {dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"k_cache: {kv_heads} KV heads do not divide q's {heads} heads")
    _check_index("token_slots", token_slots, (torch.int64,), n, q.device)
    _check_index("context_lens", context_lens, CONTEXT_DTYPES, n, q.device)
    if q.device.type == "cpu" and n > 0:
        low, high = int(token_slots.min()), int(token_slots.max())
        if low < 0 or high >= num_slots:
            raise ValueError(f"token_slots: slots must lie in [0, {num_slots}), got [{low}, {high}]")
        low, high = int(context_lens.min()), int(context_lens.max())
        if low < 1 or high > max_len:
            raise ValueError(f"context_lens: must lie in [1, {max_len}], got [{low}, {high}]")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale: expected a float, got {type(scale).__name__}")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
    if out is not None:
        if not isinstance(out, Tensor) or out.shape != q.shape:
            raise ValueError(f"out: expected shape {tuple(q.shape)}")
        if out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out: expected {q.dtype} on {q.device}, got {out.dtype} on {out.device}")
        if out.stride(2) != 1:
            raise ValueError("out: the last dimension must be contiguous (stride 1)")
    return heads // kv_heads


def _check_index(name: str, index: Tensor, dtypes: tuple, n: int, device: torch.device) -> None:
    if not isinstance(index, Tensor) or index.dim() != 1 or index.shape[0] != n:
        raise ValueError(f"{name}: expected a 1-D tensor with one entry per query row ({n})")
    if index.dtype not in dtypes:
        raise ValueError(f"{name}: dtype must be {' or '.join(map(str, dtypes))}, got {index.dtype}")
    if index.device != device:
        raise ValueError(f"{name}: on {index.device}, but q is on {device}")


def slot_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, token_slots: Tensor,
                             context_lens: Tensor, *, scale: float,
                             sliding_window: int | None = None, out: Tensor | None = None) -> Tensor:
    """Attention of each query row over its own slot's cached keys: the plain PyTorch spec.

    Same contract as `attention_kernel.slot_attention` (see the module docstring): returns
    (N, H, D) in q's dtype, written into `out` when given. Gathers every row's whole slot, so
    it is for tests, not for serving. Raises ValueError on bad arguments (check_attention_args).
    """
    group = check_attention_args(q, k_cache, v_cache, token_slots, context_lens, scale,
                                 sliding_window, out)
    max_len = k_cache.shape[1]
    k = k_cache.index_select(0, token_slots).repeat_interleave(group, dim=2)  # (N, L, H, D)
    v = v_cache.index_select(0, token_slots).repeat_interleave(group, dim=2)
    keys = torch.arange(max_len, device=q.device)  # (L,)
    ctx = context_lens.long().unsqueeze(1)  # (N, 1)
    allowed = keys < ctx  # (N, L)
    if sliding_window is not None:
        allowed &= keys >= ctx - sliding_window
    scores = torch.einsum("nhd,nlhd->nhl", q.float(), k.float()) * scale  # (N, H, L)
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.einsum("nhl,nlhd->nhd", probs, v.float()).to(q.dtype)  # (N, H, D)
    if out is None:
        return result
    out.copy_(result)
    return out
