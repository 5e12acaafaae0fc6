"""The decoder (Llama / Qwen2 / Qwen3 / Mistral / Phi-3 families) with a per-slot KV cache.

One `forward` is one engine step over S sequences. Sequence i writes the K/V of its new tokens
into slot `slots[i]` at positions `starts[i] .. starts[i] + lens[i] - 1` and attends causally
over positions `[0, starts[i] + lens[i])` of that slot only. Decode sequences (one new token)
share ONE attention call per layer over a masked window; prefill chunks (several new tokens,
possibly continuing an earlier chunk) get one call each. What a slot holds beyond its length
is never read, so the engine "resets" a slot by setting its length to 0.

Tensor parallelism lives in the layers of gpu_worker/runtime/parallel.py; this file never calls
torch.distributed. The hot path reads no device values on the host (no `.item()`), so the
engine's CPU work overlaps the GPU, and the decode path reads only tensors of the batch, so it
can be captured in a CUDA graph with static ForwardBatch buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpu_worker.runtime.attention_kernel import slot_attention
from gpu_worker.runtime.model_config import ModelConfig
from gpu_worker.runtime.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)


@dataclass
class ForwardBatch:
    """One engine step: S sequences, N new tokens in total, sequence-major.

    Derived tensors are built once per step here and shared by every layer.
    """

    input_ids: Tensor  # (N,) int64
    positions: Tensor  # (N,) int64, absolute position of each new token in its slot
    slots: list[int]
    starts: list[int]  # tokens already in each slot's KV cache
    lens: list[int]  # new tokens per sequence
    token_slots: Tensor  # (N,) int64, slot of each new token (KV cache write index)
    # (O,) flat index of each token whose logits the step returns: the last `outputs[i]` new
    # tokens of sequence i (its last one by default); None when every token is one (N == O == S)
    last_index: Tensor | None
    decode_seqs: list[int]  # sequences with one new token, batched into one attention call
    decode_token_index: Tensor | None  # (D,) their flat token index; None when all decode
    decode_slots: Tensor  # (D,) int64
    decode_slot_start: int | None  # a when the decode slots are a, a+1, ...: read a cache view
    decode_context: Tensor  # (D,) int64, context length after this step (start + 1)
    decode_window: int  # keys read per decode sequence: >= max(decode_context)
    prefill_seqs: list[tuple[int, int, int, int, int]]  # (seq, token offset, slot, start, len)
    # (N,) int64 context length of each new token (position + 1). Set: every token attends
    # through one slot_attention call per layer (CUDA; any mix of decode and prefill rows,
    # graph-capturable); None: SDPA per prefill chunk plus one batched decode call.
    token_context: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, slots: list[int], starts: list[int], new_tokens: list[list[int]],
              device: torch.device | str, *, decode_window: int | None = None,
              slot_attention: bool = False, outputs: list[int] | None = None) -> ForwardBatch:
        """Build the step's tensors (one host-to-device copy per tensor).

        `outputs[i]`: how many of sequence i's last new tokens get logits (1 each by default;
        a row verifying drafted tokens needs them at every position, `output_index`).

        `decode_window` fixes the number of keys the batched decode attention reads (a CUDA
        graph needs the same shapes every replay); by default it is the longest decode
        context of this step. Raises ValueError for mismatched lists, an empty token list, a
        negative start, a slot named twice or a window shorter than a decode context.
        """
        if not (len(slots) == len(starts) == len(new_tokens)) or not slots:
            raise ValueError("slots, starts and new_tokens must be non-empty and equally long")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: a slot appears twice in one step: {slots}")
        lens = [len(tokens) for tokens in new_tokens]
        if min(lens) < 1:
            raise ValueError("new_tokens: every sequence needs at least one new token")
        if min(starts) < 0 or min(slots) < 0:
            raise ValueError("starts and slots must be non-negative")
        ids, positions, token_slots, last, prefill = [], [], [], [], []
        decode = []
        for i, (slot, start, tokens) in enumerate(zip(slots, starts, new_tokens, strict=True)):
            offset = len(ids)
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            token_slots.extend([slot] * len(tokens))
            last.append(len(ids) - 1)
            if len(tokens) == 1:
                decode.append(i)
            else:
                prefill.append((i, offset, slot, start, len(tokens)))
        context = [starts[i] + 1 for i in decode]
        decode_slots = [slots[i] for i in decode]
        window = max(context, default=0) if decode_window is None else decode_window
        if context and window < max(context):
            raise ValueError(f"decode_window {window} is shorter than a decode context {max(context)}")
        all_decode = len(decode) == len(slots)
        out = output_index(lens, outputs)

        def tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        return cls(
            input_ids=tensor(ids), positions=tensor(positions), slots=list(slots),
            starts=list(starts), lens=lens, token_slots=tensor(token_slots),
            last_index=None if all_decode else tensor(out),
            decode_seqs=decode,
            decode_token_index=None if all_decode else tensor([last[i] for i in decode]),
            decode_slots=tensor(decode_slots), decode_context=tensor(context),
            decode_slot_start=(decode_slots[0] if decode_slots and decode_slots == list(
                range(decode_slots[0], decode_slots[0] + len(decode_slots))) else None),
            decode_window=window, prefill_seqs=prefill,
            token_context=tensor([p + 1 for p in positions]) if slot_attention else None)


def output_index(lens: list[int], outputs: list[int] | None) -> list[int]:
    """Flat indices of the tokens that get logits: the last `outputs[i]` (default 1) of the
    `lens[i]` new tokens of each sequence, sequence-major. Raises ValueError for a count
    outside 1..lens[i]."""
    index, at = [], 0
    for i, n in enumerate(lens):
        k = 1 if outputs is None else outputs[i]
        if not 1 <= k <= n:
            raise ValueError(f"outputs[{i}]: {k} logits asked of a sequence of {n} new tokens")
        index.extend(range(at + n - k, at + n))
        at += n
    return index


def feed_tokens(input_ids: torch.Tensor, source: torch.Tensor, dst: list[int],
                src: list[int]) -> None:
    """input_ids[dst[i]] = source[src[i]] on the device (a decode row's newest token, sampled
    by the previous step and not yet on the host)."""
    index = torch.tensor([dst, src], dtype=torch.int64)
    if input_ids.is_cuda:
        index = index.pin_memory().to(input_ids.device, non_blocking=True)
    feed_indexed(input_ids, source, index[0], index[1])


def feed_indexed(input_ids: torch.Tensor, source: torch.Tensor, dst: torch.Tensor,
                 src: torch.Tensor) -> None:
    """`feed_tokens` with its indices already on the device (a CUDA graph's staged inputs)."""
    input_ids.index_copy_(0, dst, source.index_select(0, src))


def rope_inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """(inv_freq (head_dim/2,) float32, attention factor) for the config's RoPE type, with
    the formulas transformers uses. `dynamic` equals plain RoPE up to
    max_position_embeddings, which is as far as a cache of this model may grow."""
    dim = config.rotary_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (dim/2,)
    base_freq = 1.0 / (config.rope_theta ** exponent)
    params = config.rope_scaling
    rope_type = params["rope_type"] if params else "default"
    if rope_type in ("default", "dynamic"):
        return base_freq, 1.0
    factor = float(params["factor"])
    if rope_type == "linear":
        return base_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config, params)
    raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: Tensor, params: dict) -> Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(config: ModelConfig, params: dict) -> tuple[Tensor, float]:
    # YaRN: interpolate the low-frequency dims, extrapolate the high ones, ramp in between;
    # cos/sin are scaled by an attention factor that grows with log(factor).
    dim, base = config.rotary_dim, config.rope_theta
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # (dim/2,)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (N, heads, head_dim); cos/sin: (N, 1, rotary_dim); halves of the first rotary_dim
    # dims rotated as transformers does, the rest (partial rotary) passed through
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as transformers does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class _StepMasks:
    """Attention masks of one step, shared by every layer."""

    decode: Tensor | None  # (D, 1, 1, W) bool
    prefill: list[Tensor | None]  # per prefill chunk: (L, W) bool, or None for plain causal


class Attention(nn.Module):
    """GQA self-attention over the slot KV cache; q/k/v column-parallel, o row-parallel."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hd = config.head_dim
        self.head_dim = hd
        self.heads = config.num_heads // tp.size
        self.kv_heads = config.num_kv_heads // tp.size
        self.group = self.heads // self.kv_heads  # query heads per KV head
        self.scale = hd ** -0.5
        self.sliding_window = config.sliding_window
        self.qkv = ColumnParallelLinear(
            config.hidden_size, [config.num_heads * hd, config.num_kv_heads * hd,
                                 config.num_kv_heads * hd], tp, config.attention_bias, dtype)
        self.o = RowParallelLinear(config.num_heads * hd, config.hidden_size, tp, dtype)
        # Qwen3: one RMSNorm over head_dim shared by every query (key) head, before RoPE
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype, tp.device) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype, tp.device) if config.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                masks: _StepMasks, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        n, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k = q.view(n, self.heads, hd), k.view(n, self.kv_heads, hd)  # (N, H|KV, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotate(q, cos, sin)  # (N, H, hd)
        k = _rotate(k, cos, sin)  # (N, KV, hd)
        # Write this step's K/V first, so every sequence then reads its whole context from
        # the cache. k_cache: (slots, max_len, KV, hd)
        index = (batch.token_slots, batch.positions)
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v.view(n, self.kv_heads, hd))
        if batch.token_context is not None:  # every token over its own slot, one launch
            out = slot_attention(q, k_cache, v_cache, batch.token_slots, batch.token_context,
                                 scale=self.scale, sliding_window=self.sliding_window)
            return self.o(out.view(n, self.heads * hd))
        if batch.decode_token_index is None:  # every sequence decodes: q is already (D, H, hd)
            return self.o(self._decode(q, batch, masks.decode, k_cache, v_cache))
        out = q.new_empty(n, self.heads * hd)  # (N, H * hd)
        if batch.decode_seqs:
            dq = q.index_select(0, batch.decode_token_index)
            out.index_copy_(0, batch.decode_token_index,
                            self._decode(dq, batch, masks.decode, k_cache, v_cache))
        for (_, offset, slot, start, length), mask in zip(batch.prefill_seqs, masks.prefill,
                                                          strict=True):
            out[offset:offset + length] = self._prefill(
                q[offset:offset + length], k_cache[slot, :start + length],
                v_cache[slot, :start + length], mask)
        return self.o(out)

    def _decode(self, q: Tensor, batch: ForwardBatch, mask: Tensor, k_cache: Tensor,
                v_cache: Tensor) -> Tensor:
        # One query per sequence: the `group` query heads sharing a KV head are stacked as
        # that KV head's query rows, so GQA needs no K/V expansion.
        d, w = q.shape[0], batch.decode_window
        q = q.view(d, self.kv_heads, self.group, self.head_dim)  # (D, KV, G, hd)
        if batch.decode_slot_start is not None:  # consecutive slots: a view, no gather copy
            a = batch.decode_slot_start
            k, v = k_cache[a:a + d, :w], v_cache[a:a + d, :w]
        else:
            k = k_cache[:, :w].index_select(0, batch.decode_slots)
            v = v_cache[:, :w].index_select(0, batch.decode_slots)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (D, KV, W, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(d, self.heads * self.head_dim)  # (D, H * hd)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        # q: (L, H, hd); k, v: (W, KV, hd) with W = start + L
        length = q.shape[0]
        k = k.repeat_interleave(self.group, dim=1).transpose(0, 1).unsqueeze(0)  # (1, H, W, hd)
        v = v.repeat_interleave(self.group, dim=1).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, is_causal=mask is None,
            scale=self.scale)  # (1, H, L, hd)
        return out[0].transpose(0, 1).reshape(length, self.heads * self.head_dim)  # (L, H * hd)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up fused and column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        size = config.intermediate_size
        self.local = size // tp.size
        self.gate_up = ColumnParallelLinear(config.hidden_size, [size, size], tp, False, dtype)
        self.down = RowParallelLinear(size, config.hidden_size, tp, dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.local, dim=-1)  # (N, I/tp) each
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, tp.device)
        self.attn = Attention(config, tp, dtype)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, tp.device)
        self.mlp = MLP(config, tp, dtype)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                masks: _StepMasks, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin, batch, masks, k_cache, v_cache)
        return h + self.mlp(self.post_attn_norm(h))


class Transformer(nn.Module):
    """The decoder of one TP rank. Build with `load_model`; call `allocate_kv_cache` before
    the first forward."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        config.check_tp(tp.size)
        self.config, self.tp, self.dtype = config, tp, dtype
        self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, tp, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, tp.device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype,
                                      tied=self.embed if config.tie_word_embeddings else None)
        inv_freq, self.rope_attention_factor = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(tp.device), persistent=False)
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None

    def allocate_kv_cache(self, num_slots: int, max_len: int) -> None:
        """Allocate (replacing any earlier cache) K and V buffers of shape
        (layers, num_slots, max_len, local_kv_heads, head_dim), zero-filled so that padded
        reads are finite. Raises ValueError for non-positive sizes, or a `max_len` past
        max_position_embeddings under `dynamic` RoPE (which this runtime does not rescale)."""
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be positive, got {num_slots}, {max_len}")
        scaling = self.config.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic" and max_len > self.config.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings} under dynamic RoPE")
        self.k_cache = self.v_cache = None  # free the old cache before allocating the new one
        shape = (self.config.num_layers, num_slots, max_len,
                 self.config.num_kv_heads // self.tp.size, self.config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.tp.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.tp.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> Tensor:
        """Run one step: returns (O, vocab_size) float32 logits, one row per output token
        (`last_index`: each sequence's last new token unless the batch asked for more), the
        full row on every rank. Writes the new tokens' K/V into their slots.
        Raises RuntimeError before any cache write when no cache is allocated and ValueError
        when a sequence would run past the cache's max_len or its slot does not exist."""
        if self.k_cache is None:
            raise RuntimeError("allocate_kv_cache must be called before forward")
        num_slots, max_len = self.k_cache.shape[1], self.k_cache.shape[2]
        ends = [s + n for s, n in zip(batch.starts, batch.lens, strict=True)]
        if max(ends) > max_len or batch.decode_window > max_len:
            raise ValueError(f"a sequence reaches {max(ends)} tokens, past max_len {max_len}")
        if max(batch.slots) >= num_slots:
            raise ValueError(f"slot {max(batch.slots)} does not exist ({num_slots} slots)")
        h = self.embed(batch.input_ids)  # (N, hidden)
        cos, sin = self._rope(batch.positions)
        masks = self._masks(batch) if batch.token_context is None else _StepMasks(None, [])
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, batch, masks, self.k_cache[i], self.v_cache[i])
        if batch.last_index is not None:
            h = h.index_select(0, batch.last_index)  # (O, hidden)
        return self.lm_head(self.norm(h))  # (O, vocab) float32

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq  # (N, hd/2), float32
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, rotary_dim)
        cos = (emb.cos() * self.rope_attention_factor).to(self.dtype)
        sin = (emb.sin() * self.rope_attention_factor).to(self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, rotary_dim): broadcast over heads

    def _masks(self, batch: ForwardBatch) -> _StepMasks:
        window = self.config.sliding_window
        device = batch.input_ids.device
        decode = None
        if batch.decode_seqs:
            keys = torch.arange(batch.decode_window, device=device)  # (W,)
            ctx = batch.decode_context.unsqueeze(1)  # (D, 1)
            decode = keys < ctx  # (D, W)
            if window is not None:
                decode &= keys >= ctx - window
            decode = decode[:, None, None, :]  # (D, 1, 1, W): same for every head and row
        prefill = []
        for _, _, _, start, length in batch.prefill_seqs:
            if start == 0 and (window is None or window >= length):
                prefill.append(None)  # plain causal: lets SDPA use its fused kernels
                continue
            query = torch.arange(start, start + length, device=device).unsqueeze(1)  # (L, 1)
            keys = torch.arange(start + length, device=device)  # (W,)
            mask = keys <= query  # (L, W)
            if window is not None:
                mask &= keys > query - window
            prefill.append(mask)
        return _StepMasks(decode, prefill)
