"""Hugging Face interop: model families mapped to Megatron-Core, streaming rank-local import, and
the Stable Latent MoE as a transformers model.

    from megatron_slmoe.hf import open_hf_checkpoint, load_hf_weights
    hf = open_hf_checkpoint(hf_dir)              # checks, no process group needed
    model = ... built from hf.model_config ...  # e.g. convert.build_model_in_layout
    load_hf_weights([model], hf_dir, hf)        # every rank: only its own slices

The fine-tuning entry point does the same with ``--hf-checkpoint DIR`` (the run settings
``model.hf_checkpoint``, ``hf_shape_check``, ``hf_unmap_mib`` of ``megatron_slmoe.model.config``).

Modules: ``checkpoint`` (the directory: index, shards, slices, block FP8), ``mappings`` (one
module per family, the mapping kinds and expert layouts they share), ``loader`` (import into a
built model), ``convert`` (build + import + Megatron dist checkpoint; ``slmoe-convert-hf``),
``peft_export`` / ``merged_export`` / ``megatron_export`` (adapters and weights out: PEFT adapters,
merged HF checkpoints, a Megatron model's weights), ``peft_import`` (PEFT adapters in),
``slmoe_model`` (``StableLatentMoeForCausalLM``; importing it registers it with transformers'
Auto classes). Errors are one :class:`HFCheckpointError` line naming the file and the tensor.
"""

from megatron_slmoe.hf.errors import HFCheckpointError
from megatron_slmoe.hf.loader import HFModel, load_hf_weights, open_hf_checkpoint

__all__ = ["HFCheckpointError", "HFModel", "load_hf_weights", "open_hf_checkpoint"]
