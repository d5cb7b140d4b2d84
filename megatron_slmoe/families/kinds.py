"""Mapping kinds: how one Megatron tensor is made of Hugging Face tensors, as rectangular pieces.

A mapping kind turns the *global* (unsharded) shape of a Megatron tensor into a list of
:class:`Piece`: a box of the Megatron tensor and the equally sized box of one HF tensor it equals.
Everything else follows from the pieces, in both directions and for any shard:

* import (``to_megatron``): a rank holds a box of each global Megatron tensor (its TP/EP shard,
  given by Megatron's own ``sharded_state_dict``); intersecting it with the pieces says which
  slice of which HF tensor to read, and where it goes;
* export (``to_hf``, the export issue): the same intersection says where each part of a local
  shard lands in the HF tensors.

Kinds: :class:`Direct` (a plain copy), :class:`Stack` (HF tensors stacked on the first dimension:
a gated MLP's ``gate | up`` into ``linear_fc1``), :class:`GroupedQKV` (q, k, v interleaved per
query group as Megatron's ``linear_qkv`` holds them, so a TP shard is whole groups) and
:class:`PerExpert` (a stacked ``[experts, ...]`` Megatron tensor from one HF tensor, or one stack
of them, per expert). HF names are templates over placeholders (``{layer}``, ``{expert}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_slmoe.families.layouts import template_regex

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension


@dataclass(frozen=True)
class Piece:
    """``megatron[meg_box]`` equals ``hf[hf_box]`` of the HF tensor ``hf_key``.

    ``hf_dims[k]`` is the HF dimension that Megatron dimension k runs along, or None for a
    Megatron dimension of extent 1 in the box that the HF tensor does not have (the expert axis
    of a per-expert HF tensor). ``hf_shape`` is the full shape the HF tensor must have.
    """

    hf_key: str
    meg_box: Box
    hf_start: tuple[int, ...]
    hf_dims: tuple[Optional[int], ...]
    hf_shape: tuple[int, ...]

    def within(self, local_box: Box) -> Optional["Overlap"]:
        """The part of this piece inside ``local_box`` (global Megatron coordinates), if any."""
        meg = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(self.meg_box, local_box))
        if any(lo >= hi for lo, hi in meg):
            return None
        hf = [slice(0, 0)] * len(self.hf_shape)
        for k, (lo, hi) in enumerate(meg):
            h = self.hf_dims[k]
            if h is not None:
                begin = self.hf_start[h] + lo - self.meg_box[k][0]
                hf[h] = slice(begin, begin + hi - lo)
        local = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(meg, local_box))
        return Overlap(self, tuple(hf), local)


@dataclass(frozen=True)
class Overlap:
    """A piece cut to one shard: ``hf_tensor[hf_index]`` goes to ``local_tensor[local_index]``."""

    piece: Piece
    hf_index: tuple[slice, ...]
    local_index: tuple[slice, ...]

    def _hf_order(self) -> tuple[list[int], list[int]]:
        kept = [k for k, h in enumerate(self.piece.hf_dims) if h is not None]
        return kept, [self.piece.hf_dims[k] for k in kept]

    def to_megatron(self, hf_block: torch.Tensor, local: torch.Tensor) -> None:
        """Write the HF block (as read: HF dimension order) into the local Megatron shard."""
        _, order = self._hf_order()
        target = local[self.local_index]
        target.copy_(hf_block.permute(*order).reshape(target.shape))

    def to_hf(self, local: torch.Tensor) -> torch.Tensor:
        """The block of the HF tensor this overlap covers (HF dimension order), from the local
        Megatron shard."""
        kept, order = self._hf_order()
        block = local[self.local_index]
        block = block.reshape([block.shape[k] for k in kept])
        return block.permute(*sorted(range(len(order)), key=order.__getitem__))


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


class MappingKind:
    """One kind of tensor: ``pieces(global_shape, names)`` with ``names`` the placeholder values."""

    def pieces(self, shape: tuple[int, ...], names: dict) -> list[Piece]:
        raise NotImplementedError

    def hf_templates(self) -> list[str]:
        raise NotImplementedError


class Direct(MappingKind):
    """The Megatron tensor is the HF tensor (any shape)."""

    def __init__(self, hf: str) -> None:
        self.hf = hf

    def pieces(self, shape, names):
        return [Piece(self.hf.format(**names), full_box(shape), (0,) * len(shape),
                      tuple(range(len(shape))), tuple(shape))]

    def hf_templates(self):
        return [self.hf]


class Stack(MappingKind):
    """HF tensors of equal shape stacked on the first dimension: ``[a; b; ...]`` (a gated MLP's
    ``linear_fc1`` is ``[gate; up]``)."""

    def __init__(self, *hf: str) -> None:
        self.hf = hf

    def pieces(self, shape, names):
        rows, rest = shape[0], tuple(shape[1:])
        if rows % len(self.hf):
            raise ValueError(f"{rows} rows do not split into {len(self.hf)} stacked tensors")
        part = rows // len(self.hf)
        return [Piece(hf.format(**names), ((i * part, (i + 1) * part), *full_box(rest)),
                      (0,) * len(shape), tuple(range(len(shape))), (part, *rest))
                for i, hf in enumerate(self.hf)]

    def hf_templates(self):
        return list(self.hf)


class GroupedQKV(MappingKind):
    """Megatron's ``linear_qkv`` (weight or bias): per query group g, the rows of its
    ``heads / groups`` query heads, then its key head, then its value head (so a TP shard holds
    whole groups). HF holds q, k and v as separate tensors, heads in order."""

    def __init__(self, q: str, k: str, v: str, heads: int, groups: int, head_dim: int) -> None:
        if heads % groups:
            raise ValueError(f"{heads} attention heads do not split into {groups} query groups")
        self.q, self.k, self.v = q, k, v
        self.heads, self.groups, self.head_dim = heads, groups, head_dim

    def pieces(self, shape, names):
        per_group = self.heads // self.groups
        d, rest = self.head_dim, tuple(shape[1:])
        group_rows = (per_group + 2) * d
        if shape[0] != self.groups * group_rows:
            raise ValueError(f"linear_qkv has {shape[0]} rows, {self.heads} heads in "
                             f"{self.groups} groups of width {d} need {self.groups * group_rows}")
        q_shape = (self.heads * d, *rest)
        kv_shape = (self.groups * d, *rest)
        dims = tuple(range(len(shape)))
        zeros = (0,) * len(rest)
        pieces = []
        for g in range(self.groups):
            row = g * group_rows
            for hf, rows, start, hf_shape in (
                (self.q, per_group * d, g * per_group * d, q_shape),
                (self.k, d, g * d, kv_shape),
                (self.v, d, g * d, kv_shape),
            ):
                pieces.append(Piece(hf.format(**names), ((row, row + rows), *full_box(rest)),
                                    (start, *zeros), dims, hf_shape))
                row += rows
        return pieces

    def hf_templates(self):
        return [self.q, self.k, self.v]


class PerExpert(MappingKind):
    """A Megatron tensor stacked over experts (``[experts, ...]``, the global expert index on the
    first dimension): expert e is ``inner`` with ``{expert}`` = e."""

    def __init__(self, inner: MappingKind) -> None:
        self.inner = inner

    def pieces(self, shape, names):
        pieces = []
        for e in range(shape[0]):
            for p in self.inner.pieces(tuple(shape[1:]), {**names, "expert": e}):
                pieces.append(Piece(p.hf_key, ((e, e + 1), *p.meg_box), p.hf_start,
                                    (None, *p.hf_dims), p.hf_shape))
        return pieces

    def hf_templates(self):
        return self.inner.hf_templates()


# --- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Megatron tensors named by ``megatron`` (a template: ``decoder.layers.{layer}.x.weight``)
    are made as ``kind`` says."""

    megatron: str
    kind: MappingKind


class MappingTable:
    """The rules of one model: Megatron tensor name -> pieces of HF tensors.

    ``derive(names)`` adds placeholders the HF templates use beyond those in the Megatron name
    (NemotronH: Megatron layer i holds HF blocks 2i and 2i+1).
    """

    def __init__(self, rules: Sequence[Rule], derive=None) -> None:
        self.rules = list(rules)
        self._compiled = [(template_regex(r.megatron), r) for r in self.rules]
        self._derive = derive

    def under(self, prefix: str) -> "MappingTable":
        """The same rules for a model that holds this one's tensors under ``prefix`` (the
        language model of an image-text model)."""
        return MappingTable([Rule(prefix + r.megatron, r.kind) for r in self.rules],
                            self._derive)

    def names(self, names: dict) -> dict:
        """The placeholders of a Megatron name's numbers (``layer``, ``expert``) and those
        derived from them, for formatting the HF templates."""
        return self._derive(names) if self._derive else names

    def match(self, megatron_key: str) -> Optional[tuple[Rule, dict]]:
        for regex, rule in self._compiled:
            m = regex.match(megatron_key)
            if m:
                return rule, self.names({k: int(v) for k, v in m.groupdict().items()})
        return None

    def pieces(self, megatron_key: str, global_shape: tuple[int, ...]) -> Optional[list[Piece]]:
        found = self.match(megatron_key)
        if found is None:
            return None
        rule, names = found
        return rule.kind.pieces(tuple(global_shape), names)
