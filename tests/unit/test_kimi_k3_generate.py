"""Generation on Kimi K3: a tiny K3 release checkpoint (13 layers, KDA and gated NoPE MLA layers,
Attention Residual blocks of 3, MXFP4 experts) answers greedily, token for token, what the plain K3
reference's greedy decoding (the whole sequence recomputed per token, each prompt alone, fp64)
answers: through ``TextGenerator`` with the inference context (KDA's state and MLA's KV cache;
prompts of different lengths in one right-padded batch, an end-of-sequence token cutting an
answer, a prefill longer than one chunk of the KDA core) and without it, through
``slmoe-generate --hf-checkpoint`` and through a run's held-out answers
(``inference.answers.held_out_answers``). A pad in front of a prompt changes the reference's
answer, so a generator that fed one to the recurrent state would fail here."""

import copy
import json

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref

pytestmark = pytest.mark.usefixtures("megatron_single_rank")

MAX_NEW = 7
PROMPT_LENGTHS = (5, 9, 5, 7)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """(reference in fp64, checkpoint directory with a ChatML tokenizer, our imported model,
    the tokenizer); the model's vocabulary is the tokenizer's, so both choose among the same
    tokens."""
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint

    directory = tmp_path_factory.mktemp("k3") / "release"
    directory.mkdir()
    hf_models.save_chatml_tokenizer(directory)
    tokenizer = load_tokenizer(str(directory))
    reference = k3ref.round_experts_to_mxfp4_(
        k3ref.build(k3ref.tiny_config(vocab_size=tokenizer.vocab_size)))
    hf_models.save_kimi_k3(reference, directory)
    hf = open_hf_checkpoint(str(directory), check_shapes=False)
    ours, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([ours], str(directory), hf)
    return copy.deepcopy(reference).double().eval(), directory, ours, tokenizer


def _reference_answers(reference, prompts, max_new, eos_id):
    """The reference's greedy answers, without the end-of-sequence token (as ours are)."""
    answers = k3ref.greedy_decode(reference, prompts, max_new, eos_id)
    return [a[:-1] if a and a[-1] == eos_id else a for a in answers]


def test_generator_with_kda_state_and_mla_cache_gives_the_reference_answers(k3):
    from megatron_slmoe.inference import TextGenerator

    reference, _, ours, tokenizer = k3
    vocab = tokenizer.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    free = k3ref.greedy_decode(reference, prompts, MAX_NEW)
    # An end-of-sequence token the first prompt produces mid-answer, so that answer is cut.
    eos = free[0][3]
    assert eos not in free[0][:3]
    expected = _reference_answers(reference, prompts, MAX_NEW, eos)
    assert len(expected[0]) == 3 and len({tuple(a) for a in expected}) == len(prompts)

    for use_kv_cache in (True, False):
        # One batch: the prefill runs to the shortest prompt, the longer ones step through the
        # rest of theirs while the short ones generate.
        answers = TextGenerator(ours, eos, vocab, use_kv_cache=use_kv_cache).generate(prompts,
                                                                                    MAX_NEW)
        assert answers == expected, f"use_kv_cache={use_kv_cache}"

    # A prefill over more than one of the chunked KDA core's chunks (64 tokens), continued.
    long = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 75)]
    answers = TextGenerator(ours, eos, vocab).generate(long, MAX_NEW)
    assert answers == _reference_answers(reference, long, MAX_NEW, eos) and all(answers)

    # Left padding would change the answer: the recurrent state cannot mask a pad.
    padded = k3ref.greedy_decode(reference, [[tokenizer.pad_id] * 2 + prompts[1]], MAX_NEW)
    assert padded[0] != free[1]


def test_slmoe_generate_on_the_release_checkpoint_answers_as_the_reference(k3, tmp_path):
    from megatron_slmoe.commands.generate import main
    from megatron_slmoe.inference.answers import request_for

    reference, directory, _, tokenizer = k3
    records = [{"prompt": "two one"}, {"prompt": "Answer in digits: nine nine two one"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "answers.jsonl"
    assert main(["--hf-checkpoint", str(directory), "--prompts", str(prompts), "--output",
                 str(out), "--max-new-tokens", str(MAX_NEW)]) == 0
    ids = [request_for(tokenizer, [{"role": "user", "content": r["prompt"]}], MAX_NEW).prompt_ids
           for r in records]
    assert len({len(i) for i in ids}) == 2
    expected = _reference_answers(reference, ids, MAX_NEW, tokenizer.eos_id)
    answers = [json.loads(line)["answer"] for line in out.read_text().splitlines()]
    assert answers == [tokenizer.decode(a) for a in expected]


def test_held_out_answers_of_a_run_are_the_reference_answers(k3):
    from megatron_slmoe.inference.answers import held_out_answers, request_for

    reference, _, ours, tokenizer = k3
    conversations = [[{"role": "user", "content": "Answer in digits: two"},
                      {"role": "assistant", "content": "2"}],
                     [{"role": "user", "content": "Answer in digits: nine one two one nine"},
                      {"role": "assistant", "content": "91219"}]]
    ours.train()  # as a run holds it between steps
    requests = [request_for(tokenizer, m) for m in conversations]
    rows = held_out_answers(ours, tokenizer, requests, 0, 1).rows
    assert ours.training
    expected = [tokenizer.decode(a) for r in requests for a in _reference_answers(
        reference, [r.prompt_ids], r.max_new_tokens, tokenizer.eos_id)]
    assert [answer for _, answer, _ in rows] == expected
