"""Fixes for Megatron-Core code paths that break when TransformerEngine is not installed.

Applied on every platform, but only when TransformerEngine is absent (always on CPU; on GPU
clusters TE is normally present and nothing here is applied).
"""

from __future__ import annotations

import copy
import importlib.util
import sys

from megatron_slmoe.platform.patching import PatchRegistry


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def register_without_te(registry: PatchRegistry) -> None:
    if transformer_engine_installed():
        return
    registry.define_missing(
        "megatron.core.transformer.moe.moe_utils.te_general_gemm",
        None,
        "the router's gating GEMM reads this name, defined only when TE imports",
    )
    registry.register(
        "megatron.core.transformer.multi_latent_attention.HAVE_TE",
        False,
        "its TE import succeeds with mock classes when TE is absent, and isinstance on them fails",
    )
    registry.wrap(
        "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
        _norm_with_sequence_parallel,
        "plain torch norms refuse sequence parallelism, which MoE with TP>1 requires",
    )
    registry.wrap(
        "megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__",
        _clip_norms_without_te,
        "its default ln_pre/ln_post (torch.nn.LayerNorm) cannot take the config= that "
        "build_module passes; use Megatron's WrappedTorchNorm",
    )
    registry.wrap(
        "megatron.core.models.multimodal.llava_model.LLaVAModel.__init__",
        _llava_sequence_parallel_without_te,
        "asserts TE attention under sequence parallelism; Megatron's local attention is "
        "sequence-parallel as in GPTModel (the QKV projection gathers the sequence)",
    )


def _norm_with_sequence_parallel(original_new):
    """Build the plain torch norm, then mark its weights as sequence-parallel.

    With sequence parallelism each TP rank normalises its own slice of the sequence with the same
    (replicated) weights; Megatron's finalize_model_grads all-reduces the grads of parameters
    marked ``sequence_parallel`` over the TP group, which is all that support needs.
    """

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain_config = copy.copy(config)
        plain_config.sequence_parallel = False
        norm = original_new(cls, plain_config, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(__new__)


def _clip_norms_without_te(original_init):
    """Default the ViT's ln_pre/ln_post to Megatron's WrappedTorchNorm (a LayerNorm here)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def __init__(self, transformer_config, transformer_layer_spec, *args, **kwargs):
        if not args:  # the norms are the first optional arguments
            kwargs.setdefault("ln_pre_impl", WrappedTorchNorm)
            kwargs.setdefault("ln_post_impl", WrappedTorchNorm)
        original_init(self, transformer_config, transformer_layer_spec, *args, **kwargs)

    return __init__


def _llava_sequence_parallel_without_te(original_init):
    """Build LLaVAModel under sequence parallelism with Megatron's local attention.

    LLaVAModel's constructor asserts TE's attention when the language config is sequence
    parallel; nothing else in it depends on TE. Sequence parallelism is hidden from that check
    only: the language model (LLaVAModel builds it through the module's ``GPTModel`` name) is built
    with it on, and the model scatters its combined sequence as it would with TE.
    """

    def __init__(self, language_transformer_config, *args, **kwargs):
        config = language_transformer_config
        if not config.sequence_parallel or config.context_parallel_size > 1:
            original_init(self, config, *args, **kwargs)
            return
        module = sys.modules[original_init.__module__]
        gpt_model = module.GPTModel

        def gpt_model_sequence_parallel(*gpt_args, **gpt_kwargs):
            config.sequence_parallel = True
            return gpt_model(*gpt_args, **gpt_kwargs)

        config.sequence_parallel = False
        module.GPTModel = gpt_model_sequence_parallel
        try:
            original_init(self, config, *args, **kwargs)
        finally:
            module.GPTModel = gpt_model
            config.sequence_parallel = True
        self.sequence_parallel_lm = True

    return __init__
