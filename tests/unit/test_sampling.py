"""Choosing the next token (megatron_slmoe.inference.sampling) against independent computations:
greedy is the argmax; temperature sampling draws each token as often as softmax(logits / T)
says; top-p draws only from the nucleus computed by a plain loop over the sorted probabilities;
a prompt's draws depend on its own generator only; bad settings are one-line errors."""

import math

import pytest
import torch

from megatron_slmoe.inference.sampling import (SamplingConfig, nucleus_mask, prompt_generator,
                                               sample_next_tokens)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def _draws(sampling, count, logits=LOGITS):
    generators = [prompt_generator(sampling.seed, i) for i in range(count)]
    return sample_next_tokens(logits.expand(count, -1), sampling, generators)


def test_greedy_is_the_argmax():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next_tokens(logits, SamplingConfig(), []), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_follow_the_softmax(temperature):
    count = 8000
    draws = _draws(SamplingConfig(temperature=temperature, seed=1), count)
    frequencies = torch.bincount(draws, minlength=len(LOGITS)).double() / count
    expected = torch.softmax(LOGITS.double() / temperature, dim=-1)
    # Five standard errors of a binomial frequency.
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / count)
    assert ((frequencies - expected).abs() <= tolerance).all(), (frequencies, expected)


def _nucleus_by_loop(probs, top_p):
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.8, 0.95, 1.0])
def test_top_p_draws_only_from_the_nucleus_in_proportion(top_p):
    probs = torch.softmax(LOGITS.double(), dim=-1)
    nucleus = _nucleus_by_loop(probs.tolist(), top_p)
    mask = nucleus_mask(probs.unsqueeze(0), top_p)[0]
    assert {i for i, keep in enumerate(mask.tolist()) if keep} == nucleus
    count = 6000
    draws = _draws(SamplingConfig(temperature=1.0, top_p=top_p, seed=2), count)
    assert set(draws.tolist()) == nucleus
    kept = torch.tensor(sorted(nucleus))
    expected = probs[kept] / probs[kept].sum()
    frequencies = torch.bincount(draws, minlength=len(LOGITS)).double()[kept] / count
    assert ((frequencies - expected).abs() <= 5 * torch.sqrt(expected * (1 - expected) / count)
            + 1e-12).all()


def test_a_prompts_draws_do_not_depend_on_its_batch():
    sampling = SamplingConfig(temperature=1.0, seed=3)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    together = sample_next_tokens(logits, sampling, [prompt_generator(3, i) for i in range(4)])
    alone = [sample_next_tokens(logits[i:i + 1], sampling, [prompt_generator(3, i)]).item()
             for i in range(4)]
    assert together.tolist() == alone
    # Rows that do not draw leave their generators untouched.
    generators = [prompt_generator(3, i) for i in range(4)]
    sample_next_tokens(logits, sampling, generators, torch.tensor([True, False, True, False]))
    assert [torch.rand((), generator=g).item() for g in generators[1::2]] == \
           [torch.rand((), generator=prompt_generator(3, i)).item() for i in (1, 3)]


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": -1.0}, "--temperature"),
    ({"temperature": math.inf}, "--temperature"),
    ({"temperature": 1.0, "top_p": 0.0}, "--top-p"),
    ({"top_p": 0.5}, "--top-p needs --temperature"),
])
def test_bad_settings_are_one_line(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingConfig(**kwargs)
