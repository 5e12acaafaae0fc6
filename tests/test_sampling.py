"""Sampling after the mask: greedy, filters, distribution, dead rows, per-request determinism."""

import math

import pytest
import torch

from gpu_worker.sampling.noise import uniform_noise
from gpu_worker.sampling.sampler import SamplingBatch, sample


def batch(n_rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0):
    def column(value):
        return list(value) if isinstance(value, (list, tuple)) else [value] * n_rows
    seeds = list(range(n_rows)) if seed is None else column(seed)
    return SamplingBatch.from_lists(column(temperature), column(top_k), column(top_p),
                                    column(min_p), seeds, column(step))


def test_greedy_takes_the_argmax_with_the_first_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    tokens, dead = sample(logits, batch(2, temperature=0.0))
    assert tokens.tolist() == [1, 0] and not dead.any()


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = torch.randn(4, 50)
    tokens, _ = sample(logits, batch(4, temperature=[0.0, 1.0, 0.0, 0.7]))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_a_rows_token_does_not_depend_on_other_rows_or_its_row_index():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    params = batch(6, temperature=[1.0, 0.8, 1.3, 0.5, 1.0, 2.0], top_k=[0, 20, 0, 5, 0, 0],
                   top_p=[1.0, 1.0, 0.9, 1.0, 0.5, 1.0], min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.05],
                   seed=[11, 22, 33, 44, 55, 66], step=[0, 3, 7, 1, 9, 2])
    tokens, _ = sample(logits, params)
    for row in range(6):
        alone = SamplingBatch.from_lists(
            [params.temperature[row].item()], [int(params.top_k[row])],
            [params.top_p[row].item()], [params.min_p[row].item()], [int(params.seed[row])],
            [int(params.step[row])])
        # Same request alone in a batch with no filters elsewhere, and in another row.
        assert sample(logits[row:row + 1], alone)[0].item() == tokens[row].item()
        other = torch.randn(3, 300)
        other[1] = logits[row]
        shuffled = SamplingBatch.from_lists(
            [1.0, params.temperature[row].item(), 0.0], [7, int(params.top_k[row]), 0],
            [0.3, params.top_p[row].item(), 1.0], [0.2, params.min_p[row].item(), 0.0],
            [1, int(params.seed[row]), 2], [5, int(params.step[row]), 0])
        assert sample(other, shuffled)[0][1].item() == tokens[row].item()


def test_same_logits_sampled_twice_give_the_same_tokens():
    logits = torch.randn(8, 1000)
    params = batch(8, temperature=0.9, top_p=0.95, seed=[7] * 8, step=list(range(8)))
    first, _ = sample(logits, params)
    again, _ = sample(logits.clone(), params)
    assert torch.equal(first, again)


def test_seed_and_step_change_the_noise():
    seed = torch.tensor([1, 1, 2], dtype=torch.int64)
    step = torch.tensor([0, 1, 0], dtype=torch.int64)
    u = uniform_noise(seed, step, 64)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u > 0).all() and (u < 1).all()
    assert torch.equal(u, uniform_noise(seed, step, 64))


def test_samples_follow_softmax_of_logits_over_temperature():
    # Chi-square over many requests (seeds); fixed seed set, loose bound.
    logits_row = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0, 1.5, 0.2])
    temperature, n_draws = 0.7, 4000
    logits = logits_row.repeat(n_draws, 1)
    params = batch(n_draws, temperature=temperature, seed=list(range(1000, 1000 + n_draws)))
    tokens, _ = sample(logits, params)
    observed = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits_row.double() / temperature, dim=0) * n_draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 30.0  # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4


def test_steps_of_one_request_follow_the_distribution_too():
    logits_row = torch.tensor([0.0, 1.0, 2.0, 0.5])
    n_draws = 4000
    params = batch(n_draws, temperature=1.0, seed=[123] * n_draws, step=list(range(n_draws)))
    tokens, _ = sample(logits_row.repeat(n_draws, 1), params)
    observed = torch.bincount(tokens, minlength=4).double()
    expected = torch.softmax(logits_row.double(), dim=0) * n_draws
    assert ((observed - expected) ** 2 / expected).sum().item() < 25.0  # 3 dof


def test_top_k_never_picks_a_token_outside_the_k_best():
    logits = torch.randn(500, 40)
    tokens, _ = sample(logits, batch(500, temperature=2.0, top_k=3))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens[:, None]).any(dim=-1).all()


def test_top_p_never_picks_a_token_outside_the_nucleus():
    logits = torch.randn(500, 40) * 2
    top_p = 0.6
    tokens, _ = sample(logits, batch(500, temperature=1.0, top_p=top_p))
    probs = torch.softmax(logits, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    mass_before = ordered.cumsum(-1) - ordered
    for row in range(500):
        nucleus = order[row][mass_before[row] < top_p]
        assert tokens[row] in nucleus


def test_min_p_never_picks_a_token_below_min_p_times_the_best():
    logits = torch.randn(500, 40) * 2
    tokens, _ = sample(logits, batch(500, temperature=1.5, min_p=0.3))
    probs = torch.softmax(logits / 1.5, dim=-1)
    picked = probs.gather(1, tokens[:, None]).squeeze(1)
    assert (picked >= 0.3 * probs.max(dim=-1).values * (1 - 1e-5)).all()


def test_filters_combine_in_order_top_k_then_top_p():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, 3.8]]).repeat(300, 1)
    tokens, _ = sample(logits, batch(300, top_k=2, top_p=0.3))
    assert set(tokens.tolist()) <= {0, 1}


def test_masked_tokens_are_never_sampled():
    logits = torch.randn(300, 64)
    logits[:, ::2] = float("-inf")
    tokens, dead = sample(logits, batch(300, temperature=5.0, top_p=0.99))
    assert (tokens % 2 == 1).all() and not dead.any()


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.8)])
def test_dead_row_is_flagged_without_nan_and_other_rows_unchanged(temperature, top_p):
    logits = torch.randn(3, 100)
    params = batch(3, temperature=temperature, top_p=top_p, min_p=0.1)
    expected, _ = sample(logits, params)
    logits[1] = float("-inf")
    tokens, dead = sample(logits, params)
    assert dead.tolist() == [False, True, False]
    assert tokens[1] == 0
    assert tokens[0] == expected[0] and tokens[2] == expected[2]


def test_bf16_derived_logits_sample_fine():
    logits = torch.randn(64, 3000).to(torch.bfloat16).float()  # many exact ties
    logits[:, 2000:] = float("-inf")
    params = batch(64, temperature=[0.0, 1.0] * 32, top_k=[0, 50] * 32)
    tokens, dead = sample(logits, params)
    assert not dead.any() and (tokens < 2000).all()
    assert torch.equal(tokens[::2], logits[::2].argmax(dim=-1))


def test_logits_are_not_modified():
    logits = torch.randn(4, 100)
    before = logits.clone()
    sample(logits, batch(4, temperature=1.0, top_k=5, top_p=0.9, min_p=0.1))
    assert torch.equal(logits, before)


def test_flags_from_tensors_match_from_lists():
    from_lists = batch(3, temperature=[0.0, 1.0, 0.5], top_k=[0, 3, 0], top_p=1.0, min_p=0.0)
    fields = {name: getattr(from_lists, name) for name in
              ("temperature", "top_k", "top_p", "min_p", "seed", "step")}
    assert SamplingBatch(**fields).flags == from_lists.flags
    assert from_lists.flags.any_top_k and not from_lists.flags.any_top_p


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_k", -1),
                                          ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0)])
def test_bad_parameter_values_raise_naming_the_field(field, value):
    kwargs = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"^{field}:"):
        batch(2, **kwargs)
    good = batch(2)
    tensors = {name: getattr(good, name).clone() for name in
               ("temperature", "top_k", "top_p", "min_p", "seed", "step")}
    tensors[field][0] = value
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingBatch(**tensors)


def test_bad_shapes_raise_naming_the_argument():
    with pytest.raises(ValueError, match="^logits:"):
        sample(torch.randn(3, 10), batch(2))
    with pytest.raises(ValueError, match="^logits:"):
        sample(torch.randn(2, 10, dtype=torch.float64), batch(2))
    good = batch(2)
    with pytest.raises(ValueError, match="^top_k:"):
        SamplingBatch(good.temperature, good.top_k.long(), good.top_p, good.min_p, good.seed,
                      good.step)
    with pytest.raises(ValueError, match="^seed:"):
        SamplingBatch(good.temperature, good.top_k, good.top_p, good.min_p, good.seed[:1],
                      good.step)


def test_noise_hash_stays_within_int64_for_extreme_seeds():
    seed = torch.tensor([-(2**63), 2**63 - 1, -1, 0], dtype=torch.int64)
    step = torch.tensor([2**40, 0, 1, 2**32 - 1], dtype=torch.int64)
    u = uniform_noise(seed, step, 1000)
    assert torch.isfinite(-(-u.log()).log()).all()
    assert math.isclose(u.mean().item(), 0.5, abs_tol=0.02)


def test_cpu_noise_is_the_int64_hash_bit_for_bit():
    # On the CPU uniform_noise runs the hash in NumPy uint32 (noise.noise_cpu); the int64
    # form is what CUDA runs (and the fused kernel matches): the same bits for every seed,
    # step and token, extremes included.
    from gpu_worker.sampling import noise

    seed = torch.tensor([-(2**63), 2**63 - 1, -1, 0, 12345, 2**31, 2**32 + 7], dtype=torch.int64)
    step = torch.tensor([2**40, 0, 1, 2**32 - 1, 99, 2**31 - 1, 3], dtype=torch.int64)
    n_cols = 70_000  # token ids past 2**16: every bit of the id feeds the hash
    want = noise.noise_int64(noise.row_keys(seed, step), n_cols)
    got = uniform_noise(seed, step, n_cols)
    assert got.dtype == torch.float32 and got.shape == (7, n_cols)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_temperature_sampling_is_the_exponential_race_on_the_noise():
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(3))
    logits[2, 100:] = float("-inf")  # a masked row
    params = batch(6, temperature=[0.5, 1.0, 0.8, 1.7, 0.0, 1.0], seed=[9, 9, 4, 1, 2, 3],
                   step=[0, 1, 2, 3, 4, 5])
    tokens, dead = sample(logits, params)
    u = uniform_noise(params.seed, params.step, 3000)
    race = logits / params.temperature.clamp(min=1e-6)[:, None] - (-u.log()).log()
    want = race.argmax(dim=-1)
    want[4] = logits[4].argmax()  # temperature 0: greedy
    assert tokens.tolist() == want.tolist() and not dead.any()
    assert tokens[2] < 100
