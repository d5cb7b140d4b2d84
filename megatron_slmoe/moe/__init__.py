"""Stable Latent MoE: router, latent projections, dispatchers, experts, the layer, its specs."""
