"""A plain MoonViT3D (Kimi K3's vision tower) and ``patchmergerv2`` projector over a state dict
under the release's names, written from the official code's description item by item: the
patch embedding as a matrix product, the learned grid resampled with F.interpolate, the time
embedding from its formula, 2-D RoPE as complex multiplication of adjacent dim pairs, attention
as an explicit softmax within each item, the temporal mean and the 2 x 2 merge as loops.
Nothing shared with the package."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, rows, cols, theta):
    """x [n, heads, d]: the dim pairs (2j, 2j+1) as complex numbers; pair 2i turns by
    col * f_i and pair 2i+1 by row * f_i, f_i = theta^(-4i/d)."""
    n, heads, d = x.shape
    f = theta ** (-torch.arange(0, d, 4, dtype=torch.float64) / d)  # d/4
    angle = torch.stack([cols[:, None] * f, rows[:, None] * f], dim=-1).reshape(n, d // 2)
    z = torch.view_as_complex(x.double().reshape(n, heads, d // 2, 2).contiguous())
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    return torch.view_as_real(z).reshape(n, heads, d).to(x.dtype)


def tower(state: dict, cfg, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``[tokens, hidden * merge^2]`` before the projector (the merged patches, flattened)."""
    p = "vision_tower."
    eps = torch.finfo(pixels.dtype).eps
    heads, d = cfg.num_heads, cfg.qkv_hidden_size // cfg.num_heads
    conv = state[p + "patch_embed.proj.weight"].flatten(1)
    table = state[p + "patch_embed.pos_emb.weight"]
    out, start = [], 0
    for t, h, w in grid.tolist():
        n = t * h * w
        x = pixels[start:start + n].flatten(1) @ conv.T
        start += n
        pos = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")[0]
        pos = pos.permute(1, 2, 0).reshape(h * w, -1)
        frames = []
        for f in range(t):
            time = torch.tensor([math.sin(f / 10000 ** (2 * i / cfg.hidden_size))
                                 for i in range(cfg.hidden_size // 2)]
                                + [math.cos(f / 10000 ** (2 * i / cfg.hidden_size))
                                   for i in range(cfg.hidden_size // 2)])
            frames.append(pos + (time if t > 1 else 0.0))
        x = x + torch.cat(frames)
        rows = torch.tensor([r for _ in range(t) for r in range(h) for _ in range(w)],
                            dtype=torch.float64)
        cols = torch.tensor([c for _ in range(t) for _ in range(h) for c in range(w)],
                            dtype=torch.float64)
        for layer in range(cfg.num_layers):
            b = f"{p}encoder.blocks.{layer}."
            y = _rms(x, state[b + "norm0.weight"], eps)
            q, k, v = (y @ state[b + "wqkv.weight"].T).reshape(n, 3, heads, d).unbind(1)
            q, k = _rope(q, rows, cols, cfg.rope_theta), _rope(k, rows, cols, cfg.rope_theta)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
            x = x + attended @ state[b + "wo.weight"].T
            y = _rms(x, state[b + "norm1.weight"], eps)
            hidden = F.gelu(y @ state[b + "mlp.fc0.weight"].T, approximate="tanh")
            x = x + hidden @ state[b + "mlp.fc1.weight"].T
        x = _rms(x, state[p + "encoder.final_layernorm.weight"], eps)
        frames = x.reshape(t, h, w, -1).mean(0)
        m = cfg.merge
        for r in range(0, h, m):
            for c in range(0, w, m):
                out.append(torch.cat([frames[r + i, c + j] for i in range(m) for j in range(m)]))
    return torch.stack(out)


def projector(state: dict, cfg, merged: torch.Tensor) -> torch.Tensor:
    y = F.gelu(merged @ state["mm_projector.proj.0.weight"].T)
    y = y @ state["mm_projector.proj.2.weight"].T
    return _rms(y, state["mm_projector.post_norm.weight"], cfg.projector_eps)


def video(state: dict, cfg, pixels: torch.Tensor, frames: int, h: int, w: int) -> torch.Tensor:
    """A whole video's merged patches: its ``frames`` frames (``pixels`` [frames * h * w, ...],
    frame after frame) cut into chunks of ``cfg.pos_frames`` (the last keeps the rest), each
    chunk through the tower as one item (its own time embedding from frame 0, pooled over its
    frames), the chunks' tokens in order."""
    out = []
    for first in range(0, frames, cfg.pos_frames):
        count = min(cfg.pos_frames, frames - first)
        chunk = pixels[first * h * w:(first + count) * h * w]
        out.append(tower(state, cfg, chunk, torch.tensor([[count, h, w]])))
    return torch.cat(out)
