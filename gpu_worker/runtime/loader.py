"""Load a Hugging Face safetensors checkpoint into one TP rank's Transformer.

Each rank opens the files with `safe_open` and reads only its own rows/columns through
`get_slice`, so a rank never materialises another rank's shard. Single-file
(`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints both load; a
tied checkpoint may omit `lm_head.weight`. Phi-3 checkpoints store q/k/v as one `qkv_proj` and
gate/up as one `gate_up_proj`; each part is read as a row range of the fused tensor, so the
model's layers load the same way for every family.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_worker.runtime.model import Transformer
from gpu_worker.runtime.model_config import ModelConfig
from gpu_worker.runtime.parallel import ColumnParallelLinear, TensorSlice, TPGroup

log = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Checkpoint keys that carry no weights this runtime uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_dir: str | Path, tp: TPGroup, dtype: torch.dtype,
               device: torch.device | str) -> Transformer:
    """Build the Transformer for `tp.rank` and fill it from `model_dir`.

    `device` must be the TP group's device. Raises ValueError naming the file or tensor when
    config.json is bad or unsupported (see ModelConfig.from_dir), the heads do not shard over
    `tp.size`, a tensor is missing, or a tensor's shape disagrees with the config.
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    if device != tp.device:
        raise ValueError(f"device {device} is not the TP group's device {tp.device}")
    config = ModelConfig.from_dir(model_dir)
    config.check_tp(tp.size)
    model = Transformer(config, tp, dtype)
    files = _tensor_files(model_dir)
    with ExitStack() as stack:
        handles = {name: stack.enter_context(safe_open(str(model_dir / name), framework="pt"))
                   for name in sorted(set(files.values()))}

        def tensor(name: str) -> TensorSlice:
            if name not in files:
                raise ValueError(f"{model_dir}: tensor {name} is missing from the checkpoint")
            return handles[files[name]].get_slice(name)

        for name, load in _loaders(model):
            load(tensor(name), name)
    model.eval()
    log.info("loaded %s (%s, %d layers) rank %d/%d", model_dir, config.family,
             config.num_layers, tp.rank, tp.size)
    return model


def _tensor_files(model_dir: Path) -> dict[str, str]:
    """Map each tensor name to the safetensors file (relative to model_dir) that holds it."""
    index = model_dir / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: cannot read weight_map: {exc}") from None
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).exists()})
        if missing:
            raise ValueError(f"{index}: names files that do not exist: {', '.join(missing)}")
        return dict(weight_map)
    single = model_dir / _SINGLE
    if not single.exists():
        raise ValueError(f"{model_dir}: neither {_SINGLE} nor {_INDEX} found")
    with safe_open(str(single), framework="pt") as f:
        return {name: _SINGLE for name in f.keys() if not name.endswith(_IGNORED_SUFFIXES)}


Loader = Callable[[TensorSlice, str], None]


def _loaders(model: Transformer) -> Iterator[tuple[str, Loader]]:
    """(checkpoint tensor name, function copying this rank's shard of it) for every weight."""
    config = model.config
    yield "model.embed_tokens.weight", lambda s, n: model.embed.load_(s, name=n)
    yield "model.norm.weight", _replicated(model.norm.weight)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", lambda s, n: model.lm_head.load_(s, name=n)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.attn, layer.mlp
        if config.fused_projections:
            yield (f"{prefix}self_attn.qkv_proj.weight", _fused(attn.qkv))
            yield f"{prefix}mlp.gate_up_proj.weight", _fused(mlp.gate_up)
        else:
            for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                yield (f"{prefix}self_attn.{proj}.weight",
                       lambda s, n, p=part, q=attn.qkv: q.load_(s, p, name=n))
                if config.attention_bias:
                    yield (f"{prefix}self_attn.{proj}.bias",
                           lambda s, n, p=part, q=attn.qkv: q.load_bias_(s, p, name=n))
            for part, proj in enumerate(("gate_proj", "up_proj")):
                yield (f"{prefix}mlp.{proj}.weight",
                       lambda s, n, p=part, m=mlp: m.gate_up.load_(s, p, name=n))
        yield f"{prefix}self_attn.o_proj.weight", lambda s, n, o=attn.o: o.load_(s, name=n)
        if config.qk_norm:
            yield f"{prefix}self_attn.q_norm.weight", _replicated(attn.q_norm.weight)
            yield f"{prefix}self_attn.k_norm.weight", _replicated(attn.k_norm.weight)
        yield f"{prefix}mlp.down_proj.weight", lambda s, n, m=mlp: m.down.load_(s, name=n)
        yield f"{prefix}input_layernorm.weight", _replicated(layer.input_norm.weight)
        yield f"{prefix}post_attention_layernorm.weight", _replicated(layer.post_attn_norm.weight)


class _Rows:
    """Rows [start, end) of a checkpoint tensor, as a TensorSlice of their own (one part of
    a fused projection). Indexing reads only the rows asked for."""

    def __init__(self, src: TensorSlice, start: int, end: int):
        self.src, self.start, self.end = src, start, end

    def get_shape(self) -> list[int]:
        return [self.end - self.start, *self.src.get_shape()[1:]]

    def __getitem__(self, index) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        lo, hi, step = rows.indices(self.end - self.start)
        assert step == 1, "fused parts are read in contiguous row ranges"
        return self.src[(slice(self.start + lo, self.start + hi), *rest)]


def _fused(layer: ColumnParallelLinear) -> Loader:
    """A loader splitting a fused checkpoint weight (parts stacked along rows, in the order
    of `layer.output_sizes`) into the layer's parts."""

    def load(src: TensorSlice, name: str) -> None:
        total = sum(layer.output_sizes)
        shape = tuple(src.get_shape())
        if shape != (total, layer.in_features):
            raise ValueError(f"{name}: checkpoint tensor has shape {shape}, "
                             f"expected {(total, layer.in_features)}")
        start = 0
        for part, size in enumerate(layer.output_sizes):
            layer.load_(_Rows(src, start, start + size), part, name=f"{name}[part {part}]")
            start += size

    return load


def _replicated(param: torch.Tensor) -> Loader:
    """A loader for a weight every rank holds whole (norms)."""

    def load(src: TensorSlice, name: str) -> None:
        shape = tuple(src.get_shape())
        if shape != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint tensor has shape {shape}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(src[:])

    return load
