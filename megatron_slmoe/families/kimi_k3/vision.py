"""Kimi K3's vision side: the MoonViT3D tower and the ``patchmergerv2`` projector, under the
release's names (``vision_tower.*``, ``mm_projector.*``), replicated on the first pipeline stage
as the other families' towers are (``hf.tower_model``).

For an input of ``pixel_values [patches, 3, p, p]`` (every frame of every image or video chunk
cut into ``p x p`` patches in raster order) and ``grid_thws [items, 3]`` (frames, patch rows,
patch columns of each item)::

    x   = patch_embed.proj(pixels)                               a Conv2d, one token per patch
    x  += the learned position grid [G, G, d] resampled to (h, w)  (bilinear; bicubic for K2.5)
          + a sinusoidal time embedding of the frame index, when an item has t > 1 frames
    x   = blocks: x += wo(attention(norm0(x))); x += fc1(gelu_tanh(fc0(norm1(x))))
          attention within each item only, q and k rotated by 2-D RoPE: head dims in adjacent
          pairs, pair 2i by the column and 2i+1 by the row at frequency theta^(-4i / head_dim)
    x   = final_layernorm(x)
    out = mean over each item's frames, then every 2 x 2 patches concatenated  [h/2 * w/2, 4 d]
    out = post_norm(proj.2(gelu(proj.0(out))))                   one language token per 2 x 2

The same tower with layer norms, biases and bicubic resampling is Kimi-K2.5's published MoonViT
(``MoonViT3DConfig``); the tests hold it to transformers' Kimi-K2.5 tower in that form and to a
plain per-item reference in K3's. Norms take torch's RMSNorm/LayerNorm defaults as the release's
code constructs them (no eps given: RMSNorm's is the dtype's epsilon).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_slmoe.families.vision import ImageModel


@dataclass(frozen=True)
class MoonViT3DConfig:
    """The tower's and projector's shape (K3's ``vision_config`` and the text width)."""

    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    qkv_hidden_size: int = 1536
    intermediate_size: int = 4096
    patch_size: int = 14
    pos_grid: int = 64
    pos_frames: int = 4
    merge: int = 2
    text_hidden_size: int = 7168
    norm: str = "rmsnorm"
    bias: bool = False
    interpolation: str = "bilinear"
    rope_max_side: int = 512
    rope_theta: float = 10000.0
    projector_eps: float = 1e-5

    @classmethod
    def from_vision_config(cls, vision: dict, fail) -> "MoonViT3DConfig":
        """From the release's ``vision_config``; ``fail(message)`` gives the error to raise
        for what the tower does not implement."""
        for key, supported in (("merge_type", "sd2_tpool"), ("mm_projector_type", "patchmergerv2"),
                               ("pos_emb_type", "divided_fixed"), ("mlp_type", "mlp2"),
                               ("activation_func", "gelu_pytorch_tanh")):
            if vision.get(key, supported) != supported:
                raise fail(f"vision_config.{key} {vision[key]!r} is not supported "
                           f"({supported} only)")
        biases = {vision.get(k, False) for k in ("attn_bias", "linear_bias",
                                                  "patch_embed_proj_bias")}
        if len(biases) != 1:
            raise fail("vision_config: attn_bias, linear_bias and patch_embed_proj_bias must "
                       "agree")
        merge = vision.get("merge_kernel_size", [2, 2])
        if not isinstance(merge, list) or len(merge) != 2 or merge[0] != merge[1]:
            raise fail(f"vision_config.merge_kernel_size must be square, got {merge!r}")
        side = vision.get("init_pos_emb_height", 64)
        if vision.get("init_pos_emb_width", side) != side:
            raise fail("vision_config: init_pos_emb_height and init_pos_emb_width must agree")
        return cls(
            hidden_size=vision.get("vt_hidden_size", 1024),
            num_layers=vision.get("vt_num_hidden_layers", 27),
            num_heads=vision.get("vt_num_attention_heads", 12),
            qkv_hidden_size=vision.get("qkv_hidden_size", 1536),
            intermediate_size=vision.get("vt_intermediate_size", 4096),
            patch_size=vision.get("patch_size", 14), pos_grid=side,
            pos_frames=vision.get("init_pos_emb_time", 4), merge=merge[0],
            text_hidden_size=vision.get("text_hidden_size", 7168),
            norm=vision.get("norm_type", "rmsnorm"), bias=biases.pop(),
            interpolation=vision.get("pos_emb_interpolation_mode", "bilinear"),
            projector_eps=vision.get("projector_ln_eps", 1e-5))


def _norm(config: MoonViT3DConfig, size: int) -> nn.Module:
    return nn.RMSNorm(size) if config.norm == "rmsnorm" else nn.LayerNorm(size)


def time_embedding(frames: int, dim: int) -> torch.Tensor:
    """[frames, dim]: sin of f * 10000^(-2i/dim) in the first half, cos in the second."""
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(frames, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class PatchEmbed(nn.Module):
    def __init__(self, config: MoonViT3DConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Conv2d(3, config.hidden_size, config.patch_size, config.patch_size,
                              bias=config.bias)
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(
            torch.zeros(config.pos_grid, config.pos_grid, config.hidden_size))
        self.register_buffer("time_weight",
                             time_embedding(config.pos_frames, config.hidden_size),
                             persistent=False)

    def positions(self, grid_thws: torch.Tensor) -> torch.Tensor:
        """[patches, d]: each item's resampled grid, repeated over its frames (+ time)."""
        table = self.pos_emb.weight
        out = []
        for t, h, w in grid_thws.tolist():
            if t > self.config.pos_frames:
                raise ValueError(f"an item of {t} frames; the tower embeds at most "
                                 f"{self.config.pos_frames} (one chunk)")
            if (h, w) == tuple(table.shape[:2]):
                grid = table.flatten(0, 1)
            else:
                grid = F.interpolate(table.permute(2, 0, 1).unsqueeze(0), size=(h, w),
                                     mode=self.config.interpolation
                                     ).squeeze(0).permute(1, 2, 0).flatten(0, 1)
            if t > 1:
                grid = grid.unsqueeze(0) + self.time_weight[:t, None].to(grid.dtype)
            out.append(grid.reshape(-1, grid.shape[-1]))
        return torch.cat(out)

    def forward(self, pixels: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        x = self.proj(pixels).flatten(1)
        return x + self.positions(grid_thws).to(x.dtype)


def rope_cos_sin(grid_thws: torch.Tensor, head_dim: int, theta: float,
                 device) -> tuple[torch.Tensor, torch.Tensor]:
    """[patches, head_dim / 2] angles' cos and sin: pair 2i by the patch column, 2i+1 by its
    row, both at frequency theta^(-4i / head_dim) (the official code's order, which
    transformers' Kimi-K2.5 tower keeps); the same for every frame of an item."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device).float() / head_dim)
    angles = []
    for t, h, w in grid_thws.tolist():
        rows = torch.arange(h, device=device).float().repeat_interleave(w)
        cols = torch.arange(w, device=device).float().repeat(h)
        pair = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).flatten(1)
        angles.append(pair.repeat(t, 1))
    angles = torch.cat(angles)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [patches, heads, head_dim]`` rotated pair by pair (dims 2j, 2j+1), in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: MoonViT3DConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: MoonViT3DConfig) -> None:
        super().__init__()
        self.heads = config.num_heads
        self.norm0 = _norm(config, config.hidden_size)
        self.norm1 = _norm(config, config.hidden_size)
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.qkv_hidden_size, bias=config.bias)
        self.wo = nn.Linear(config.qkv_hidden_size, config.hidden_size, bias=config.bias)
        self.mlp = MLP(config)

    def attention(self, x: torch.Tensor, lengths: list[int], cos, sin) -> torch.Tensor:
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.heads, -1)).unbind(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                              vi.transpose(0, 1)).transpose(0, 1)
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.wo(torch.cat(out).flatten(1))

    def forward(self, x: torch.Tensor, lengths: list[int], cos, sin) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), lengths, cos, sin)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, config: MoonViT3DConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_layernorm = _norm(config, config.hidden_size)


class MoonViT3D(nn.Module):
    """``vision_tower``: patches -> ``[tokens, merge^2, d]`` (frames pooled, merged 2 x 2)."""

    def __init__(self, config: MoonViT3DConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)

    def forward(self, pixels: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = self.patch_embed(pixels, grid_thws)
        lengths = [t * h * w for t, h, w in grid_thws.tolist()]
        cos, sin = rope_cos_sin(grid_thws, c.qkv_hidden_size // c.num_heads, c.rope_theta,
                                x.device)
        for block in self.encoder.blocks:
            x = block(x, lengths, cos, sin)
        x = self.encoder.final_layernorm(x)
        merged = []
        for item, (t, h, w) in zip(x.split(lengths), grid_thws.tolist()):
            m = c.merge
            grid = item.view(t, h // m, m, w // m, m, -1).permute(0, 1, 3, 2, 4, 5).mean(0)
            merged.append(grid.reshape((h // m) * (w // m), m * m, -1))
        return torch.cat(merged)


class PatchMergerV2(nn.Module):
    """``mm_projector``: ``[tokens, merge^2 d]`` -> ``post_norm(proj.2(gelu(proj.0(x))))``."""

    def __init__(self, config: MoonViT3DConfig) -> None:
        super().__init__()
        width = config.hidden_size * config.merge ** 2
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, config.text_hidden_size, bias=False))
        self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x.flatten(1)))


class KimiK3Vision(ImageModel):
    """MoonViT3D and the projector: ``(pixel_values, grid_thws)`` -> one text-width embedding per
    merged patch ``[tokens, text hidden]``, items in order. Stored at the checkpoint's top level
    under the module's own names."""

    hf_prefix = ""
    lora_regions = {"vision_tower": "vision", "mm_projector": "projector"}
    lora_attention_linears = ("vision_tower.encoder.blocks.*.wqkv",
                              "vision_tower.encoder.blocks.*.wo")

    def __init__(self, config: MoonViT3DConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = MoonViT3D(config)
        self.mm_projector = PatchMergerV2(config)

    def layer_shape(self) -> dict[str, int]:
        c = self.config
        return {"layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
                "ffn_hidden": c.intermediate_size, "patches_per_position": c.merge ** 2}

    def blank_image(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        pixels = torch.zeros(c.merge ** 2, 3, c.patch_size, c.patch_size, device=device,
                             dtype=self.mm_projector.proj[0].weight.dtype)
        return pixels, torch.tensor([[1, c.merge, c.merge]], device=device)

    def forward(self, pixel_values: torch.Tensor,
                image_grid_thw: torch.Tensor) -> torch.Tensor:
        merged = self.vision_tower(pixel_values, image_grid_thw)
        return self.mm_projector(merged.to(self.mm_projector.proj[0].weight.dtype))


def merged_tokens(grid_thws: torch.Tensor, merge: int = 2) -> list[int]:
    """Language tokens per item: one per merged patch of one (pooled) frame."""
    return [(h // merge) * (w // merge) for _, h, w in grid_thws.tolist()]


def check_grid(grid_thws: torch.Tensor, config: MoonViT3DConfig,
               where: Optional[str] = None) -> None:
    """Every item's grid fits the tower: sides divisible by the merge, within the RoPE's side."""
    for t, h, w in grid_thws.tolist():
        if h % config.merge or w % config.merge or max(h, w) > config.rope_max_side or t < 1:
            raise ValueError(f"{where + ': ' if where else ''}an image grid of {t}x{h}x{w} "
                             f"patches does not fit the tower (sides divisible by "
                             f"{config.merge}, at most {config.rope_max_side})")
