"""Interleaved multimodal rotary positions (Qwen3-VL's M-RoPE) for Megatron-Core's GPTModel.

Qwen2-VL's M-RoPE, which Megatron-Core 0.16 has (``MultimodalRotaryEmbedding``), gives the
temporal, height and width position each a contiguous run of rotary frequencies. Qwen3-VL
interleaves them: frequency j rotates by the height position when ``j % 3 == 1`` and ``j < 3 *
sections[1]``, by the width position when ``j % 3 == 2`` and ``j < 3 * sections[2]``, and by the
temporal position otherwise. With the three positions equal (text) it is 1D RoPE.

``InterleavedMRoPE`` has the call of Megatron's class (``forward(position_ids, mrope_section)``
-> ``[s, b, 1, dim]`` frequencies for ``apply_rotary_pos_emb``), so GPTModel's ``mrope`` path uses
it unchanged; unlike Megatron's it builds its frequencies where the positions are (Megatron's
puts them on the current CUDA device at construction) and holds no state-dict entry.
"""

from __future__ import annotations

from typing import List, Optional

import torch


class InterleavedMRoPE(torch.nn.Module):
    def __init__(self, kv_channels: int, rotary_base: float = 10000.0,
                 rotary_percent: float = 1.0) -> None:
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        # A plain attribute: no buffer in the state dict, as Megatron's.
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32)
                                               / dim))

    def axis_of_frequency(self, mrope_section: List[int]) -> torch.Tensor:
        """[dim / 2]: which position (0 temporal, 1 height, 2 width) rotates each frequency."""
        half = self.inv_freq.numel()
        if sum(mrope_section) != half or len(mrope_section) != 3:
            raise ValueError(f"mrope_section {mrope_section} must be 3 sections summing to "
                             f"{half} (half the rotary dimension)")
        axis = torch.zeros(half, dtype=torch.long)
        for which, offset in ((1, 1), (2, 2)):
            axis[offset:3 * mrope_section[which]:3] = which
        return axis

    def forward(self, position_ids: torch.Tensor, mrope_section: List[int],
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
        """``position_ids`` [3, b, s] (or [b, s]: the same position on every axis) ->
        ``[s, b, 1, dim]`` rotary frequencies (the first half repeated, as rotate-half
        rotary takes them)."""
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("context parallelism with interleaved M-RoPE")
        if position_ids.dim() == 2:
            position_ids = position_ids.expand(3, -1, -1)
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # [3, b, s, dim / 2]
        axis = self.axis_of_frequency(mrope_section).to(position_ids.device)
        chosen = freqs.gather(0, axis.expand(1, *freqs.shape[1:-1], -1)).squeeze(0)
        emb = torch.cat((chosen, chosen), dim=-1)  # [b, s, dim]
        return emb.transpose(0, 1)[:, :, None, :].contiguous()
