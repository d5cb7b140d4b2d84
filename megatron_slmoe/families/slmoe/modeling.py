"""The Stable Latent MoE as a transformers model: ``StableLatentMoeConfig`` and
``StableLatentMoeForCausalLM``, registered with transformers' Auto classes on import
(``model_type: stable_latent_moe``).

It computes what megatron_slmoe's Megatron model computes, so a checkpoint runs in transformers like
any other model and the flagship's weights have a published format (``megatron_slmoe.hf`` imports
it rank-locally, ``families/slmoe/family.py`` is its table):

* attention: GQA with optional per-head q/k RMSNorm (Megatron's ``qk_layernorm``), RoPE on all of
  the head (rotate-half), no biases;
* dense layers: an MLP, SwiGLU (``hidden_act: silu``) or non-gated squared ReLU
  (``hidden_act: relu2``, ``mlp_gated: false``), as Megatron's ``gated_linear_unit`` and
  ``activation_func`` choose; the experts and the shared expert use the same kind;
* MoE layers (``moe_layers``, one 0/1 per layer): Megatron-Core's top-k routing on full-width fp32
  logits (softmax, with or without pre-softmax, or sigmoid with normalised top-k and an optional
  expert bias used for the choice only), group-limited routing scoring a group by its top
  ``topk / group_topk`` experts, a scaling factor; then the latent down-projection
  (``fc1_latent_proj``, hidden -> ``moe_latent_size``), the routed experts in the latent width, the
  up-projection (``fc2_latent_proj``) and a full-width shared expert.

Experts are held fused as 3D tensors (``experts.gate_up_proj`` ``[E, 2F, L]`` gate rows first, or
``experts.up_proj`` ``[E, F, L]``; ``experts.down_proj`` ``[E, L, F]``), the layout transformers 5
uses in memory. On disk they are one tensor per expert (``experts.3.gate_proj.weight``), as for
Qwen3-MoE: the conversion registered below makes ``from_pretrained`` fuse them and
``save_pretrained`` split them again (``save_original_format=False`` saves them fused; both
load). This module needs only torch and transformers, so it can travel with a checkpoint.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

MODEL_TYPE = "stable_latent_moe"


class StableLatentMoeConfig(PretrainedConfig):
    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        intermediate_size: int = 2816,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 16,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        qk_layernorm: bool = False,
        hidden_act: str = "silu",
        mlp_gated: bool = True,
        max_position_embeddings: int = 4096,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        attention_dropout: float = 0.0,
        num_experts: int = 64,
        num_experts_per_tok: int = 4,
        moe_intermediate_size: int = 1024,
        moe_latent_size: Optional[int] = None,
        shared_expert_intermediate_size: Optional[int] = None,
        moe_layers: Optional[list] = None,
        router_score_function: str = "softmax",
        router_pre_softmax: bool = False,
        router_expert_bias: bool = False,
        router_num_groups: Optional[int] = None,
        router_group_topk: Optional[int] = None,
        router_topk_scaling_factor: Optional[float] = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.qk_layernorm = qk_layernorm
        self.hidden_act = hidden_act
        self.mlp_gated = mlp_gated
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attention_dropout = attention_dropout
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_latent_size = moe_latent_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.moe_layers = list(moe_layers) if moe_layers is not None else [1] * num_hidden_layers
        self.router_score_function = router_score_function
        self.router_pre_softmax = router_pre_softmax
        self.router_expert_bias = router_expert_bias
        self.router_num_groups = router_num_groups
        self.router_group_topk = router_group_topk
        self.router_topk_scaling_factor = router_topk_scaling_factor
        if len(self.moe_layers) != num_hidden_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for "
                             f"{num_hidden_layers} layers")
        if router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"router_score_function must be softmax or sigmoid, got "
                             f"{router_score_function!r}")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class StableLatentMoeRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class StableLatentMoeRotary(nn.Module):
    def __init__(self, config: StableLatentMoeConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        dim = self.config.head_dim
        return 1.0 / (self.config.rope_theta
                      ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, S, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


class StableLatentMoeAttention(nn.Module):
    def __init__(self, config: StableLatentMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads,
                                                    config.num_key_value_heads, config.head_dim)
        self.dropout = config.attention_dropout
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        if config.qk_layernorm:
            self.q_norm = StableLatentMoeRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = StableLatentMoeRMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x_BSD, cos_sin, mask_B1SK, cache: Optional[Cache]) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, self.heads, self.head_dim)
        k = self.k_proj(x_BSD).view(B, S, self.kv_heads, self.head_dim)
        v = self.v_proj(x_BSD).view(B, S, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t.unsqueeze(2).to(q.dtype) for t in cos_sin)  # [B, S, 1, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SK,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class StableLatentMoeMLP(nn.Module):
    """A dense MLP: ``down(act(gate) * up)`` or, non-gated, ``down(act(up))``."""

    def __init__(self, config: StableLatentMoeConfig, intermediate_size: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False) if config.mlp_gated else None
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class StableLatentMoeRouter(nn.Module):
    """Megatron-Core's top-k routing (see the module doc); returns (probs_TK, experts_TK)."""

    def __init__(self, config: StableLatentMoeConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.router_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def _topk(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, k = self.config, self.config.num_experts_per_tok
        if not c.router_group_topk:
            return scores_TE.topk(k, dim=-1)
        T, E, G = scores_TE.shape[0], c.num_experts, c.router_num_groups
        group_TG = scores_TE.view(T, G, E // G).topk(k // c.router_group_topk, dim=-1)[0].sum(-1)
        chosen_TG = torch.zeros_like(group_TG).scatter_(
            1, group_TG.topk(c.router_group_topk, dim=-1, sorted=False)[1], 1.0)
        allowed_TE = chosen_TG.bool().unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        return scores_TE.masked_fill(~allowed_TE, float("-inf")).topk(k, dim=-1)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        if c.router_score_function == "softmax":
            if c.router_pre_softmax:
                probs_TK, experts_TK = self._topk(logits_TE.softmax(dim=-1))
            else:
                top_TK, experts_TK = self._topk(logits_TE)
                probs_TK = top_TK.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
            choice_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias.float()
            _, experts_TK = self._topk(choice_TE)
            probs_TK = scores_TE.gather(1, experts_TK)
            if c.num_experts_per_tok > 1:
                probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if c.router_topk_scaling_factor:
            probs_TK = probs_TK * c.router_topk_scaling_factor
        return probs_TK, experts_TK


class StableLatentMoeExperts(nn.Module):
    """The routed experts, fused: one loop step per expert that received tokens."""

    def __init__(self, config: StableLatentMoeConfig) -> None:
        super().__init__()
        E, F_ = config.num_experts, config.moe_intermediate_size
        L = config.moe_latent_size or config.hidden_size
        self.gated = config.mlp_gated
        if self.gated:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, L))
        else:
            self.up_proj = nn.Parameter(torch.empty(E, F_, L))
        self.down_proj = nn.Parameter(torch.empty(E, L, F_))
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x_TL, probs_TK, experts_TK) -> torch.Tensor:
        out_TL = torch.zeros_like(x_TL)
        fc1 = self.gate_up_proj if self.gated else self.up_proj
        for e in experts_TK.unique().tolist():
            token, slot = torch.where(experts_TK == e)
            h = F.linear(x_TL[token], fc1[e])
            if self.gated:
                gate, up = h.chunk(2, dim=-1)
                h = self.act(gate) * up
            else:
                h = self.act(h)
            y = F.linear(h, self.down_proj[e]) * probs_TK[token, slot, None].to(h.dtype)
            out_TL.index_add_(0, token, y)
        return out_TL


class StableLatentMoeBlock(nn.Module):
    def __init__(self, config: StableLatentMoeConfig) -> None:
        super().__init__()
        h, latent = config.hidden_size, config.moe_latent_size
        self.router = StableLatentMoeRouter(config)
        self.fc1_latent_proj = nn.Linear(h, latent, bias=False) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, h, bias=False) if latent else None
        self.experts = StableLatentMoeExperts(config)
        size = config.shared_expert_intermediate_size
        self.shared_experts = StableLatentMoeMLP(config, size) if size else None

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        probs_TK, experts_TK = self.router(x_TD)
        x_TL = self.fc1_latent_proj(x_TD) if self.fc1_latent_proj is not None else x_TD
        y_TL = self.experts(x_TL, probs_TK, experts_TK)
        y_TD = self.fc2_latent_proj(y_TL) if self.fc2_latent_proj is not None else y_TL
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view_as(x_BSD)


class StableLatentMoeDecoderLayer(nn.Module):
    def __init__(self, config: StableLatentMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = StableLatentMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = StableLatentMoeAttention(config, layer_idx)
        self.post_attention_layernorm = StableLatentMoeRMSNorm(config.hidden_size,
                                                               config.rms_norm_eps)
        self.mlp = (StableLatentMoeBlock(config) if config.moe_layers[layer_idx]
                    else StableLatentMoeMLP(config, config.intermediate_size))

    def forward(self, x, cos_sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class StableLatentMoePreTrainedModel(PreTrainedModel):
    config_class = StableLatentMoeConfig
    config: StableLatentMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["StableLatentMoeDecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
        elif isinstance(module, StableLatentMoeRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, StableLatentMoeRotary):
            # A non-persistent buffer: from_pretrained builds the model on the meta device, so
            # it is computed here, not read.
            module.inv_freq.copy_(module.frequencies())
        elif isinstance(module, StableLatentMoeExperts):
            for param in module.parameters():
                param.normal_(0.0, std)
        elif isinstance(module, StableLatentMoeRouter):
            module.weight.normal_(0.0, std)
            if module.expert_bias is not None:
                module.expert_bias.zero_()


class StableLatentMoeModel(StableLatentMoePreTrainedModel):
    def __init__(self, config: StableLatentMoeConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(StableLatentMoeDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = StableLatentMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = StableLatentMoeRotary(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                cache: Optional[Cache] = None, inputs_embeds=None,
                use_cache: Optional[bool] = None, **kwargs) -> BaseModelOutputWithPast:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, S = x.shape[:2]
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + S, device=x.device).expand(B, S)
        # Causal over the cached and new positions, plus the padding mask if given.
        keys = torch.arange(past + S, device=x.device)
        mask = keys[None, :] <= (past + torch.arange(S, device=x.device))[:, None]  # [S, K]
        mask = mask[None, None].expand(B, 1, S, past + S)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, -(past + S):].bool()
        cos_sin = self.rotary(position_ids)
        for layer in self.layers:
            x = layer(x, cos_sin, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x),
                                       cache=cache if use_cache else None)


class StableLatentMoeForCausalLM(StableLatentMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: StableLatentMoeConfig) -> None:
        super().__init__(config)
        self.model = StableLatentMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                cache: Optional[Cache] = None, inputs_embeds=None, labels=None,
                use_cache: Optional[bool] = None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)


AutoConfig.register(MODEL_TYPE, StableLatentMoeConfig, exist_ok=True)
AutoModelForCausalLM.register(StableLatentMoeConfig, StableLatentMoeForCausalLM, exist_ok=True)


def _register_expert_conversion() -> None:
    """Per-expert tensors on disk <-> fused 3D experts in memory, as transformers does for
    Qwen3-MoE (gated: gate rows then up rows, ``[E, 2F, L]``; non-gated: ``up_proj``)."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    register_checkpoint_conversion_mapping(MODEL_TYPE, [
        WeightConverter(source_patterns=["mlp.experts.*.gate_proj.weight",
                                         "mlp.experts.*.up_proj.weight"],
                        target_patterns="mlp.experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns="mlp.experts.*.up_proj.weight",
                        target_patterns="mlp.experts.up_proj",
                        operations=[MergeModulelist(dim=0)]),
        WeightConverter(source_patterns="mlp.experts.*.down_proj.weight",
                        target_patterns="mlp.experts.down_proj",
                        operations=[MergeModulelist(dim=0)]),
    ], overwrite=True)


_register_expert_conversion()
