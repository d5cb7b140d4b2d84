"""Our Stable Latent MoE as a Hugging Face model: the transformers definition (``modeling``) and
its config reading and tensor table (``family``)."""
