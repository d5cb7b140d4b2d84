"""Fixes for Megatron-Core code paths that break when TransformerEngine is not installed.

Applied on every platform, but only when TransformerEngine is absent (always on CPU; on GPU
clusters TE is normally present and nothing here is applied).
"""

from __future__ import annotations

import copy
import importlib.util

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
