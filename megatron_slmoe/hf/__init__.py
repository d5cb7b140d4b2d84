"""Hugging Face interop, driven by the model families (``megatron_slmoe.families``, one folder
each): streaming rank-local import, export of adapters and merged weights.

    from megatron_slmoe.hf import open_hf_checkpoint, load_hf_weights
    hf = open_hf_checkpoint(hf_dir)              # checks, no process group needed
    model = ... built from hf.model_config ...  # e.g. convert.build_model_in_layout
    load_hf_weights([model], hf_dir, hf)        # every rank: only its own slices

The fine-tuning entry point does the same with ``--hf-checkpoint DIR`` (the run settings
``model.hf_checkpoint``, ``hf_shape_check``, ``hf_unmap_mib`` of ``megatron_slmoe.model.config``).

Modules: ``checkpoint`` (the directory: index, shards, slices, block FP8), ``loader`` (import
into a built model; the family by ``config.json``'s architectures), ``vision_sources`` (a
family's vision module read by its own names), ``tower_model`` (the image-text model of a
multimodal family), ``lora_mapping`` (LoRA modules to and from HF weights by the family's table), ``convert`` (build + import + Megatron dist checkpoint; ``slmoe-convert-hf``),
``peft_export`` / ``merged_export`` / ``megatron_export`` (adapters and weights out: PEFT adapters,
merged HF checkpoints, a Megatron model's weights), ``peft_import`` (PEFT adapters in). Errors are one :class:`HFCheckpointError` line naming the file and the tensor.
"""

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.hf.loader import HFModel, load_hf_weights, open_hf_checkpoint

__all__ = ["HFCheckpointError", "HFModel", "load_hf_weights", "open_hf_checkpoint"]
