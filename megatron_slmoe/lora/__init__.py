"""LoRA fine-tuning of Megatron-Core models with Stable Latent MoE layers.

* ``targets``: the one registry of LoRA targets (which modules each name adapts, and how);
* ``inject``: :func:`inject_lora` puts adapters into the targeted modules, freezing the rest;
* ``base``, ``linear``, ``router``, ``latent``, ``experts``: the LoRA modules, by what they adapt;
* ``adapter``: layout-independent safetensors adapters (the file layout, save/load) and merging.

The LoRA settings are ``megatron_slmoe.lora.config.LoRAConfig`` (torch-free). Import from the
modules themselves: the package imports nothing, so that reading the settings stays cheap.
"""
