"""The Triton bitmask kernel (under TRITON_INTERPRET=1), and the CPU worker's kernel
(`masks.apply_token_bitmask_cpu_`, xgrammar's C++ one behind the same contract), against the
plain PyTorch reference."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_worker.guided import mask_kernel  # noqa: E402
from gpu_worker.guided.mask_kernel import KernelConfig, apply_token_bitmask_  # noqa: E402
from gpu_worker.guided.mask_reference import (  # noqa: E402
    apply_token_bitmask_reference_,
    check_mask_args,
    pack_bitmask,
    unpack_bitmask,
)
from gpu_worker.guided.masks import apply_token_bitmask_cpu_  # noqa: E402

# If another module imported triton first, the kernel would not be interpreted on the CPU.
assert mask_kernel._is_interpreted(), "set TRITON_INTERPRET=1 before triton is first imported"

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Each contract test runs on both kernels a worker applies masks with.
KERNELS = pytest.mark.parametrize("apply", [apply_token_bitmask_, apply_token_bitmask_cpu_],
                                  ids=["triton", "cpu"])


def random_case(n_batch, n_cols, n_words=None, dtype=torch.float32, allowed=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_words = (n_cols + 31) // 32 if n_words is None else n_words
    logits = torch.randn(n_batch, n_cols, generator=gen).to(dtype)
    bitmask = pack_bitmask(torch.rand(n_batch, 32 * n_words, generator=gen) < allowed)
    return logits, bitmask


def assert_matches_reference(logits, bitmask, rows=None, vocab_size=None,
                             apply=apply_token_bitmask_):
    ours, ref = logits.clone(), logits.clone()
    apply(ours, bitmask, rows, vocab_size)
    apply_token_bitmask_reference_(ref, bitmask, rows, vocab_size)
    assert torch.equal(ours, ref)
    return ours


@pytest.mark.parametrize("n_cols", [1, 31, 33, 4095, 4160, 32007])
@pytest.mark.parametrize("dtype", DTYPES)
@KERNELS
def test_kernel_matches_reference_on_awkward_vocab_sizes(n_cols, dtype, apply):
    logits, bitmask = random_case(3, n_cols, dtype=dtype, seed=n_cols)
    assert_matches_reference(logits, bitmask, apply=apply)


@pytest.mark.parametrize("dtype", DTYPES)
@KERNELS
def test_columns_past_the_mask_are_disallowed_when_logits_are_wider(dtype, apply):
    logits, bitmask = random_case(2, 4160, n_words=100, dtype=dtype, allowed=1.0)
    out = assert_matches_reference(logits, bitmask, apply=apply)
    assert torch.isinf(out[:, 3200:]).all()
    assert torch.equal(out[:, :3200], logits[:, :3200])


@pytest.mark.parametrize("dtype", DTYPES)
@KERNELS
def test_columns_past_vocab_size_are_disallowed(dtype, apply):
    logits, bitmask = random_case(2, 32007, dtype=dtype, allowed=1.0)
    out = assert_matches_reference(logits, bitmask, vocab_size=32000, apply=apply)
    assert torch.isinf(out[:, 32000:]).all() and (out[:, 32000:] < 0).all()
    assert torch.equal(out[:, :32000], logits[:, :32000])


@pytest.mark.parametrize("rows", [[0, 2, 5], [3], [], [5, 0, 3], [4, 4]],
                         ids=["some", "one", "empty", "unsorted", "duplicate"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@KERNELS
def test_unlisted_rows_are_bit_identical(rows, index_dtype, apply):
    logits, bitmask = random_case(6, 1000, dtype=torch.bfloat16)
    rows_t = torch.tensor(rows, dtype=index_dtype)
    out = assert_matches_reference(logits, bitmask, rows_t, apply=apply)
    untouched = [r for r in range(6) if r not in rows]
    assert torch.equal(out[untouched].view(torch.int16), logits[untouched].view(torch.int16))


@KERNELS
def test_row_index_picks_both_the_logits_row_and_the_bitmask_row(apply):
    logits = torch.zeros(3, 64)
    allowed = torch.zeros(3, 64, dtype=torch.bool)
    allowed[2, 7] = True  # only bitmask row 2 allows anything
    apply(logits, pack_bitmask(allowed), torch.tensor([2]))
    assert torch.equal(logits[:2], torch.zeros(2, 64))
    assert logits[2, 7] == 0 and torch.isinf(logits[2]).sum() == 63


@KERNELS
def test_row_stride_of_a_slice_of_a_bigger_tensor(apply):
    big = torch.randn(5, 3000)
    logits = big[1:4, 5:2005]  # row stride 3000, unaligned start
    bitmask = pack_bitmask(torch.rand(3, 2000) < 0.3)
    expected = big.clone()
    apply_token_bitmask_reference_(expected[1:4, 5:2005], bitmask)
    apply(logits, bitmask)
    assert torch.equal(big, expected)  # and nothing outside the slice moved


@pytest.mark.parametrize("config", [KernelConfig(4, 1), KernelConfig(32, 4),
                                    KernelConfig(128, 4)])
def test_every_launch_config_matches_reference(config):
    logits, bitmask = random_case(4, 4160, n_words=120, dtype=torch.float16)
    rows = torch.tensor([3, 1])
    ours, ref = logits.clone(), logits.clone()
    mask_kernel._launch(ours, bitmask, rows, 4000, config)
    apply_token_bitmask_reference_(ref, bitmask, rows, 4000)
    assert torch.equal(ours, ref)


@KERNELS
def test_all_allowed_row_is_unchanged_and_none_allowed_row_is_all_minus_inf(apply):
    logits = torch.randn(2, 100)
    allowed = torch.zeros(2, 100, dtype=torch.bool)
    allowed[0] = True
    out = assert_matches_reference(logits, pack_bitmask(allowed), apply=apply)
    assert torch.equal(out[0], logits[0])
    assert torch.isneginf(out[1]).all()


def test_pack_and_unpack_are_inverse():
    allowed = torch.rand(3, 77) < 0.5
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), 77), allowed)
    assert pack_bitmask(torch.ones(1, 32, dtype=torch.bool)).item() == -1


@pytest.mark.parametrize("kwargs, field", [
    (dict(logits=torch.zeros(4)), "logits"),
    (dict(logits=torch.zeros(2, 64, dtype=torch.float64)), "logits"),
    (dict(logits=torch.zeros(64, 2).t()), "logits"),
    (dict(bitmask=torch.zeros(2, 2, dtype=torch.int64)), "bitmask"),
    (dict(bitmask=torch.zeros(2, dtype=torch.int32)), "bitmask"),
    (dict(bitmask=torch.zeros(1, 2, dtype=torch.int32)), "bitmask"),
    (dict(rows=torch.tensor([0.0])), "rows"),
    (dict(rows=torch.tensor([[0]])), "rows"),
    (dict(rows=torch.tensor([2])), "rows"),
    (dict(rows=torch.tensor([-1])), "rows"),
    (dict(vocab_size=65), "vocab_size"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(vocab_size=3.0), "vocab_size"),
])
@pytest.mark.parametrize("apply", [apply_token_bitmask_, apply_token_bitmask_cpu_,
                                   apply_token_bitmask_reference_])
def test_bad_arguments_raise_value_error_naming_the_argument_and_change_nothing(kwargs, field,
                                                                               apply):
    args = dict(logits=torch.zeros(2, 64), bitmask=torch.zeros(2, 2, dtype=torch.int32),
                rows=None, vocab_size=None)
    args.update(kwargs)
    before = args["logits"].clone()
    with pytest.raises(ValueError, match=f"^{field}:"):
        apply(**args)
    assert torch.equal(args["logits"], before)


def test_default_vocab_size_is_the_narrower_of_logits_and_mask():
    assert check_mask_args(torch.zeros(1, 100), torch.zeros(1, 2, dtype=torch.int32), None,
                           None) == 64
    assert check_mask_args(torch.zeros(1, 40), torch.zeros(1, 2, dtype=torch.int32), None,
                           None) == 40


def test_small_launches_use_the_narrow_config_and_large_ones_the_table():
    assert mask_kernel.choose_config(4, 1, 32000) == mask_kernel._SMALL_CONFIG
    assert mask_kernel.choose_config(4, 256, 151936) == mask_kernel._CONFIGS[4]
    assert mask_kernel.choose_config(2, 256, 151936) == mask_kernel._CONFIGS[2]


def test_a_worker_on_a_gpu_applies_masks_with_the_triton_kernel_only():
    from gpu_worker.guided.masks import MaskFiller

    with pytest.raises(ValueError, match="^triton:"):
        MaskFiller(4, 100, torch.device("cuda"), triton=False)
