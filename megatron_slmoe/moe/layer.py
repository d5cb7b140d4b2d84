"""The Stable Latent MoE layer, a drop-in for Megatron-Core's MoE submodule of a TransformerLayer.

Per rank, for hidden states ``[S, B, d]``::

    router (full width, fp32 logits)  -> probs_TE, routing_map_TE
    latent down-projection d -> l     (skipped without moe_latent_size)
    dispatcher.dispatch               -> rows grouped by local expert
    experts                           -> probs-weighted expert outputs per row
    dispatcher.combine                -> [T, l]
    latent RMSNorm                    (with slmoe.latent_norm)
    latent up-projection l -> d, + shared expert (full width)

Router, experts and dispatcher are swappable components given by the layer spec
(``SLMoESubmodules``). The class derives from Megatron's MoELayer only so that TransformerLayer
treats it as an MoE layer; it does not use MoELayer's construction or forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.moe.config import SLMoEConfig, check_expert_tensor_parallel
from megatron_slmoe.moe.dispatch import DISPATCHERS
from megatron_slmoe.moe.experts import LatentSwiGLUExperts
from megatron_slmoe.moe.latent import LatentNorm, build_latent_projections
from megatron_slmoe.moe.router import SLMoERouter
from megatron_slmoe.moe.stages import LATENT, ROUTER, SHARED, stage


@dataclass
class SLMoESubmodules:
    router: type = SLMoERouter
    experts: Union[ModuleSpec, type] = LatentSwiGLUExperts
    shared_experts: Optional[Union[ModuleSpec, type]] = None


class StableLatentMoELayer(MoELayer):
    def __init__(self, config: TransformerConfig, submodules: SLMoESubmodules,
                 layer_number: Optional[int] = None, pg_collection=None,
                 slmoe: Optional[SLMoEConfig] = None) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        BaseMoELayer.__init__(self, config=config, layer_number=layer_number,
                              pg_collection=pg_collection)
        slmoe = slmoe or SLMoEConfig()
        check_expert_tensor_parallel(pg_collection.expt_tp.size())
        self.submodules = submodules
        self.router = submodules.router(config=config, pg_collection=pg_collection,
                                        freeze_weight=slmoe.freeze_router,
                                        freeze_expert_bias=slmoe.freeze_expert_bias)
        self.latent_down, self.latent_up = (
            build_latent_projections(config) if config.moe_latent_size else (None, None))
        if slmoe.latent_norm and not config.moe_latent_size:
            raise ConfigError("slmoe.latent_norm normalises the latent output: it needs "
                              "--moe-latent-size")
        self.latent_norm = (LatentNorm(config, config.moe_latent_size) if slmoe.latent_norm
                            else None)
        self.dispatcher = DISPATCHERS[slmoe.dispatcher](
            slmoe, config.num_moe_experts, self.local_expert_indices, pg_collection.ep)
        packed = ({"packed": slmoe.expert_weights}
                  if slmoe.expert_weights is not None and slmoe.expert_weights.held else {})
        self.experts = build_module(submodules.experts, config, self.num_local_experts,
                                    self.local_expert_indices[0], **packed)
        if self.use_shared_expert:
            self.shared_experts = build_module(submodules.shared_experts, config=config,
                                               gate=config.moe_shared_expert_gate,
                                               pg_collection=pg_collection)
        self.overlap_chunks = slmoe.overlap_chunks
        self.moe_layer_recompute = (config.recompute_granularity == "selective"
                                    and "moe" in config.recompute_modules)

    @property
    def traffic_stats(self):
        """Bytes the dispatcher sent within and between nodes (for the routing monitor)."""
        return self.dispatcher.traffic

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        if intermediate_tensors is not None:
            raise NotImplementedError("StableLatentMoELayer does not support partial CUDA-graph "
                                      "capture of the MoE layer (cuda_graph_scope moe_router)")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()  # [B, S] -> [S, B] like hidden
        if self.moe_layer_recompute:
            output = tensor_parallel.checkpoint(self._forward, False, hidden_states, padding_mask)
        else:
            output = self._forward(hidden_states, padding_mask)
        return output, None

    def _forward(self, hidden_SBD: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        with stage(ROUTER):
            probs_TE, routing_map_TE = self.router(hidden_SBD, padding_mask)
        x_SBL = hidden_SBD
        if self.latent_down is not None:
            with stage(LATENT):
                x_SBL = self.latent_down(hidden_SBD)
        x_TL = x_SBL.reshape(-1, x_SBL.shape[-1])
        y_TL = self.dispatcher.dispatch_compute_combine(
            x_TL, probs_TE, routing_map_TE, self.experts, self.overlap_chunks)
        output = y_TL.view(*hidden_SBD.shape[:-1], y_TL.shape[-1])
        if self.latent_up is not None:
            with stage(LATENT):
                if self.latent_norm is not None:
                    output = self.latent_norm(output)
                output = self.latent_up(output)
        if self.shared_experts is not None:
            with stage(SHARED):
                output = output + self.shared_experts(hidden_SBD)
        return output
