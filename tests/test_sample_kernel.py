"""The fused Gumbel-max kernel (under TRITON_INTERPRET=1) picks the same tokens as the
PyTorch sampling path it replaces on CUDA, row by row, whatever the batch."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_worker.sampling.kernel import gumbel_argmax  # noqa: E402
from gpu_worker.sampling.sampler import SamplingBatch, sample  # noqa: E402


def _batch(temps, seeds, steps):
    n = len(temps)
    return SamplingBatch.from_lists(temps, [0] * n, [1.0] * n, [0.0] * n, seeds, steps)


@pytest.mark.parametrize("n_cols", [1, 37, 4096, 5000, 9001])
def test_kernel_matches_torch_path(n_cols):
    gen = torch.Generator().manual_seed(n_cols)
    logits = torch.randn(6, n_cols, generator=gen) * 3
    logits[2, : n_cols // 2] = float("-inf")  # a masked row
    temps = [1.0, 0.7, 1.3, 0.0, 2.0, 0.5]
    # 2**40 + 5 has high seed bits; -5 is the uint64 seed 2**64 - 5 as the int64 it travels as.
    params = _batch(temps, [1, 2, 3, 4, 2**40 + 5, -5], [0, 1, 2, 3, 4, 2**33 + 5])
    expected, _ = sample(logits, params)  # CPU tensors: the PyTorch path
    got = gumbel_argmax(logits, params.temperature, params.seed, params.step)
    assert got.tolist() == expected.tolist()


def test_kernel_row_result_independent_of_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3000, generator=gen)
    params = _batch([1.0] * 5, [9, 8, 7, 6, 5], [3] * 5)
    full = gumbel_argmax(logits, params.temperature, params.seed, params.step)
    for i in range(5):
        one = gumbel_argmax(logits[i:i + 1], params.temperature[i:i + 1], params.seed[i:i + 1],
                            params.step[i:i + 1])
        assert one.item() == full[i].item()


def test_kernel_rejects_half_precision_logits():
    with pytest.raises(ValueError, match="logits"):
        gumbel_argmax(torch.zeros(1, 8, dtype=torch.bfloat16), torch.ones(1),
                      torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
