"""Building models from Megatron-Core specs: the multimodal (vision + Stable Latent MoE) model.

``multimodal``  Megatron's LLaVAModel with a CLIP/SigLIP-style ViT, its projector and our MoE
                language model (``VisionConfig``, ``build_multimodal_model``).
"""
