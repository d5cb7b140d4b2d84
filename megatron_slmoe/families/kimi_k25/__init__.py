"""Kimi-K2.5: the family (``family``: DeepSeek-V3's language model under the multimodal prefixes)
and its MoonViT tower and projector (``vision``)."""
