"""Hugging Face interop: model families mapped to Megatron-Core, streaming rank-local import, and
the Stable Latent MoE as a transformers model.

    from megatron_slmoe.hf import open_hf_checkpoint, load_hf_weights
    hf = open_hf_checkpoint(hf_dir)              # checks, no process group needed
    model = ... built from hf.model_config ...  # e.g. convert.build_model_in_layout
    load_hf_weights([model], hf_dir, hf)        # every rank: only its own slices

Modules: ``config`` (the run settings: ``--hf-checkpoint`` ...), ``checkpoint`` (the directory: index, shards, slices, block FP8), ``mappings`` (one
module per family, the mapping kinds and expert layouts they share), ``loader`` (import into a
built model), ``convert`` (build + import + Megatron dist checkpoint; ``tools/convert_hf.py``),
``slmoe_model`` (``StableLatentMoeForCausalLM``; importing it registers it with transformers'
Auto classes). Errors are one :class:`HFCheckpointError` line naming the file and the tensor.
"""

from megatron_slmoe.hf.config import HFImportConfig
from megatron_slmoe.hf.errors import HFCheckpointError
from megatron_slmoe.hf.loader import HFModel, load_hf_weights, open_hf_checkpoint

__all__ = ["HFCheckpointError", "HFImportConfig", "HFModel", "load_hf_weights", "open_hf_checkpoint"]
