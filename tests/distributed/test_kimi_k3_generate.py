"""Generation on Kimi K3 over two ranks: a tiny K3 release checkpoint (14 layers, KDA and gated
NoPE MLA on both sides of the stage boundary, Attention Residual blocks of 3) answers, with KDA's
state and MLA's KV cache, what the plain reference's greedy decoding answers, token for token:
under PP=2 (each step hands the next stage the Attention-Residual stream, the running sum and the
bank, not one hidden state; prompts of three lengths in one batch), under TP=2 (KDA and MLA heads
split; sequence parallelism, on in training, off while generating) and under EP=2 (the
data-parallel replicas answer different prompts; one runs out of batches first and keeps stepping
with an empty one for the expert all-to-all)."""

import copy

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref
from tests.helpers.ranks import run_ranks

MAX_NEW = 6


def _answers(directory: str, prompts, eos_id: int, vocab: int, max_batch_size: int):
    """Every prompt's answer: each data-parallel replica answers its contiguous share."""
    from megatron.core import parallel_state

    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights, open_hf_checkpoint
    from megatron_slmoe.inference import TextGenerator
    from megatron_slmoe.inference.answers import share_of

    hf = open_hf_checkpoint(directory, check_shapes=False)
    model, _ = build_model_in_layout(hf.model_config)
    load_hf_weights([model], directory, hf)
    share = share_of(len(prompts), parallel_state.get_data_parallel_rank(),
                     parallel_state.get_data_parallel_world_size())
    generator = TextGenerator(model, eos_id, vocab, max_batch_size=max_batch_size)
    mine = generator.generate([prompts[i] for i in share], MAX_NEW)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (share.start, mine))
    answers = {}
    for start, theirs in everyone:
        answers.update({start + i: a for i, a in enumerate(theirs)})
    return [answers[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    config = k3ref.tiny_config(num_hidden_layers=14, full_attn_layers=[4, 8, 12, 14],
                               kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13])
    model = k3ref.round_experts_to_mxfp4_(k3ref.build(config))
    directory = hf_models.save_kimi_k3(model, tmp_path_factory.mktemp("k3") / "release")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
               for n in (4, 8, 6)]
    reference = copy.deepcopy(model).double()
    eos = k3ref.greedy_decode(reference, prompts[:1], MAX_NEW)[0][2]  # cuts the first answer
    expected = [a[:-1] if a[-1] == eos else a
                for a in k3ref.greedy_decode(reference, prompts, MAX_NEW, eos)]
    assert len(expected[0]) == 2 and all(expected)
    return directory, prompts, eos, config.vocab_size, expected


# PP=2 and TP=2: the three prompts in one batch. EP=2: one prompt per batch, so the replica with
# two prompts runs two batches and the other steps through the second with an empty one.
@pytest.mark.parametrize("sizes, max_batch_size",
                         [(dict(pp=2), 4), (dict(tp=2), 4), (dict(ep=2), 1)],
                         ids=["pp2", "tp2-sp", "ep2"])
def test_two_ranks_generate_the_reference_answers(k3, sizes, max_batch_size):
    directory, prompts, eos, vocab, expected = k3
    results = run_ranks(_answers, 2, etp=1, timeout=300.0, **sizes, directory=directory,
                        prompts=prompts, eos_id=eos, vocab=vocab, max_batch_size=max_batch_size)
    for rank, answers in enumerate(results):
        assert answers == expected, f"rank {rank}"
