"""Generation with Megatron-Core's KV cache, base + adapter, in every parallel layout:

- greedy decoding with the KV cache gives, token for token, what recomputing the whole sequence at
  every step gives (one rank; prompts of different lengths in one batch);
- the same base checkpoint and adapter give the same greedy tokens on one rank and on two ranks
  with TP=2, EP=2 (the data-parallel replicas answer different prompts and keep stepping together
  for the expert all-to-all) and PP=2; sampled tokens (temperature + top-p) too, with EP=2.
"""

from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_ranks

MAX_NEW = 10
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 7}


def _prompts():
    from megatron_slmoe.data.assets import asset_path
    from megatron_slmoe.data.instruction import read_instruction_jsonl
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.inference.answers import request_for

    tokenizer = load_tokenizer(asset_path("tokenizer.json"))
    conversations = read_instruction_jsonl(asset_path("digits_eval.jsonl"))[:7]
    return [request_for(tokenizer, m).prompt_ids for m in conversations]


def _build(parallel_sizes: dict):
    from megatron_slmoe.parallel.config import ParallelConfig
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.runtime.model import build_model

    import megatron_slmoe

    model, _ = build_model(load_model_config("tiny"), ParallelConfig(**parallel_sizes), False,
                           megatron_slmoe.PLATFORM)
    return model


def _generate(model, prompts, use_kv_cache=True, sampling=None):
    from megatron.core import parallel_state

    from megatron_slmoe.inference import SamplingConfig, TextGenerator

    # Each data-parallel replica answers its contiguous share, as the command does.
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    share = -(-len(prompts) // dp_size)
    first = min(dp_rank * share, len(prompts))
    generator = TextGenerator(model, eos_id=1, vocab_size=512, max_batch_size=4,
                              use_kv_cache=use_kv_cache)
    mine = prompts[first:first + share]
    mine = generator.generate(mine, MAX_NEW, SamplingConfig(**(sampling or {})),
                              prompt_indices=range(first, first + len(mine)))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (first, mine))
    answers = {}
    for start, tokens in gathered:
        answers.update({start + i: t for i, t in enumerate(tokens)})
    return [answers[i] for i in range(len(prompts))]


def reference_case(directory: str, prompts):
    """One rank: a base with random weights and an adapter with non-zero B, saved; its answers
    with and without the KV cache."""
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.adapter import save_adapter
    from megatron_slmoe.lora.inject import inject_lora, lora_modules
    from megatron_slmoe.data.assets import asset_path
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.training.checkpointing import save_base_checkpoint

    model = _build({})
    save_base_checkpoint(model, str(Path(directory) / "base"), "tiny",
                         load_tokenizer(asset_path("tokenizer.json")))
    lora = LoRAConfig(rank=4, alpha=8.0, targets=["linear_qkv", "linear_proj", "linear_fc1",
                                                   "linear_fc2", "router", "latent"])
    inject_lora([model], lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in lora_modules([model]):
            for param in module.lora_parameters():
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    save_adapter([model], str(Path(directory) / "adapter"), lora, {"model_config": "tiny"})
    return {"cached": _generate(model, prompts), "recomputed": _generate(model, prompts, False),
            "sampled": _generate(model, prompts, sampling=SAMPLED),
            "sampled_recomputed": _generate(model, prompts, False, sampling=SAMPLED)}


def layout_case(directory: str, prompts, parallel_sizes: dict, sampled: bool):
    from megatron_slmoe.lora.adapter import load_adapter, read_adapter_config
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.config import ModelSection
    from megatron_slmoe.runtime.model import load_base_weights

    model = _build(parallel_sizes)
    load_base_weights(model, ModelSection(base_checkpoint=str(Path(directory) / "base")))
    lora, _ = read_adapter_config(str(Path(directory) / "adapter"))
    inject_lora([model], lora)
    load_adapter([model], str(Path(directory) / "adapter"))
    result = {"cached": _generate(model, prompts)}
    if sampled:
        result["sampled"] = _generate(model, prompts, sampling=SAMPLED)
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("generate")
    prompts = _prompts()
    assert len({len(p) for p in prompts}) > 1  # prompts of different lengths share batches
    result = run_ranks(reference_case, 1, directory=str(directory), prompts=prompts)[0]
    return directory, prompts, result


def test_kv_cache_gives_the_tokens_of_full_recomputation(reference):
    _, _, result = reference
    assert all(len(t) > 0 for t in result["cached"])
    assert result["cached"] == result["recomputed"]
    assert result["sampled"] == result["sampled_recomputed"]
    assert result["sampled"] != result["cached"]  # sampling is not greedy


@pytest.mark.parametrize("sizes, sampled", [
    ({"tensor_model_parallel_size": 2}, False),
    ({"expert_model_parallel_size": 2}, True),
    ({"pipeline_model_parallel_size": 2}, False),
], ids=["tp2", "ep2", "pp2"])
def test_two_ranks_generate_what_one_rank_does(reference, sizes, sampled):
    directory, prompts, expected = reference
    layout = {"tp": sizes.get("tensor_model_parallel_size", 1),
              "pp": sizes.get("pipeline_model_parallel_size", 1),
              "ep": sizes.get("expert_model_parallel_size", 1)}
    results = run_ranks(layout_case, 2, **layout, etp=1, directory=str(directory), prompts=prompts,
                        parallel_sizes=sizes, sampled=sampled)
    for rank, result in enumerate(results):
        assert result["cached"] == expected["cached"], f"rank {rank}"
        if sampled:
            assert result["sampled"] == expected["sampled"], f"rank {rank}"
