"""Model configurations (YAML files of TransformerConfig fields) and their checks, building
Megatron-Core's GPTModel with Stable Latent MoE layers, and the parameter census.

* ``config``: ``ModelConfig``, ``load_model_config``, ``packaged_configs`` (``configs/*.yaml``);
* ``validation``: every invalid model setting as one ConfigError line naming the flag;
* ``build``: the TransformerConfig of a run and the GPTModel of this rank's stage;
* ``census``: models on the meta device and their parameter counts;
* ``multimodal``: Megatron's LLaVAModel with a CLIP/SigLIP ViT, its projector and the Stable
  Latent MoE language model (``build_multimodal_model``; its settings:
  ``model.config.VisionConfig``);
* ``hf_vision``: a vision tower imported from a Hugging Face CLIP or SigLIP checkpoint, by the
  name tables of ``vision_mappings``.
"""
