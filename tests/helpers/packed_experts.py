"""A run's model from an HF checkpoint with its routed experts held packed or dequantised
(``--expert-weights``), LoRA on its experts, one forward and backward: the logits, the LoRA
gradients and the bytes the experts hold, for the packed-vs-dequantised tests."""

from __future__ import annotations

import torch


def expert_modules(model):
    from megatron_slmoe.moe.experts import LatentSwiGLUExperts

    return [m for m in model.modules() if isinstance(m, LatentSwiGLUExperts)]


def expert_weight_bytes(model) -> int:
    """Bytes of the routed experts' frozen weights this rank holds: packed buffers or dense
    parameters, counted from the tensors themselves."""
    total = 0
    for experts in expert_modules(model):
        tensors = ([experts.fc1_weight_packed, experts.fc1_weight_scale, experts.fc2_weight_packed,
                    experts.fc2_weight_scale] if experts.packed is not None
                   else [experts.fc1_weight, experts.fc2_weight])
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def run_lora_step(directory: str, mode: str, input_ids: torch.Tensor, seed: int = 0,
                  targets=("linear_fc1", "linear_fc2")):
    """(logits, {LoRA parameter name: gradient}, model) of this rank's model of ``directory``
    built as a run builds it with ``--expert-weights mode``, LoRA on ``targets`` with every factor
    drawn from ``seed`` (B too), after one backward of a fixed weighting of the logits."""
    from megatron_slmoe.hf.convert import build_model_in_layout
    from megatron_slmoe.hf.loader import load_hf_weights
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.model.config import ModelSection
    from megatron_slmoe.runtime.model import model_builder, open_model

    model_config, hf = open_model(ModelSection(hf_checkpoint=directory, expert_weights=mode))
    model, _ = build_model_in_layout(model_config, build=model_builder(build_gpt_model, hf))
    load_hf_weights([model], directory, hf)
    inject_lora([model], LoRAConfig(rank=4, alpha=8.0, targets=list(targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if getattr(param, "is_lora", False):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.train()
    batch, seq = input_ids.shape
    logits = model(input_ids, torch.arange(seq).expand(batch, seq), None)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed + 1))
    (logits * weights).sum().backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()
             if getattr(param, "is_lora", False)}
    return logits.detach(), grads, model
