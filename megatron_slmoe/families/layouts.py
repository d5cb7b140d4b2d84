"""Where a tensor of the mapping tables is stored in a checkpoint: the on-disk layouts of one name.

The tables name HF tensors as transformers writes them with ``save_pretrained`` (its "original
format", what published checkpoints hold): experts one per key
(``model.layers.3.mlp.experts.17.gate_proj.weight``), a model's historical prefix
(``backbone.`` for NemotronH). Transformers 5 holds experts fused as 3D tensors in memory
(``model.layers.3.mlp.experts.gate_up_proj`` ``[experts, 2F, d]``) and writes that layout with
``save_pretrained(save_original_format=False)``; other tools write it too. A family's
:class:`Layouts` says how its canonical names appear in either layout, so import reads both and
export can write either:

* :class:`Renamed`: a prefix stored under another name (``backbone.`` as ``model.``);
* :class:`FusedExperts`: per-expert tensors stored as one stacked tensor, several kinds of
  per-expert tensor (gate and up) concatenated along one dimension.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence



def template_regex(template: str, text: tuple[str, ...] = ()) -> re.Pattern:
    """A regex matching the names of a template: ``{x}`` is a number, unless ``x`` is in
    ``text`` (then any text, shortest first)."""
    parts = re.split(r"\{(\w+)\}", template)
    pieces = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            pieces.append(re.escape(part))
        else:
            pieces.append(rf"(?P<{part}>.+?)" if part in text else rf"(?P<{part}>\d+)")
    return re.compile("^" + "".join(pieces) + "$")


@dataclass(frozen=True)
class Renamed:
    """Names starting with ``canonical`` may be stored starting with ``stored`` instead."""

    canonical: str
    stored: str


@dataclass(frozen=True)
class FusedExperts:
    """Per-expert tensors ``parts`` (templates over ``{p}`` prefix and ``{e}`` expert) stored as
    the one tensor ``fused`` (template over ``{p}``) of shape ``[experts, ...]``, the parts
    concatenated along ``dim`` of the fused tensor (1 = the per-expert tensor's first dim)."""

    fused: str
    parts: tuple[str, ...]
    dim: int = 1
    transposed: bool = False
    """Each expert's tensor stored transposed (``[in, out]``: the published Qwen3-VL-MoE
    checkpoints'), the parts concatenated along the stored tensor's last dimension."""

    def to_fused(self, key: str) -> Optional[tuple[str, int, int]]:
        """(fused key, expert, part) of a per-expert key, or None."""
        for i, part in enumerate(self.parts):
            m = template_regex(part, text=("p",)).match(key)
            if m:
                return self.fused.format(p=m.group("p")), int(m.group("e")), i
        return None

    def from_fused(self, key: str, shape: Sequence[int]) -> Optional[list[tuple[str, tuple]]]:
        """The per-expert (key, shape) pairs a fused tensor of ``shape`` holds, or None."""
        m = template_regex(self.fused, text=("p",)).match(key)
        if not m:
            return None
        part_shape = list(shape[1:])
        if self.transposed:
            part_shape = [part_shape[-1] // len(self.parts), *part_shape[:-1]]
        else:
            part_shape[self.dim - 1] //= len(self.parts)
        return [(part.format(p=m.group("p"), e=e), tuple(part_shape))
                for e in range(shape[0]) for part in self.parts]

    def locate(self, shape: Sequence[int], expert: int, part: int) -> Optional["Resolved"]:
        """Where part ``part`` of expert ``expert`` is in a fused tensor of ``shape`` (the
        ``stored`` name left empty), or None when the tensor has no such expert."""
        shape = list(shape)
        if expert >= shape[0] or len(shape) <= self.dim:
            return None
        index = [expert] + [slice(0, n) for n in shape[1:]]
        along = len(shape) - 1 if self.transposed else self.dim
        size = shape[along] // len(self.parts)
        index[along] = slice(part * size, (part + 1) * size)
        stored_shape = tuple(s.stop - s.start for s in index[1:])
        if self.transposed:
            stored_shape = (stored_shape[-1], *stored_shape[:-1])
        return Resolved("", tuple(index), stored_shape, self.transposed)


@dataclass(frozen=True)
class Resolved:
    """A canonical name found in a checkpoint: ``stored[index]`` is the tensor (index: ints and
    slices over the stored tensor's leading dims; empty when stored as it is)."""

    stored: str
    index: tuple
    shape: tuple[int, ...]
    transposed: bool = False
    """The stored piece is the canonical tensor transposed (read it, then transpose)."""

    def compose(self, inner: Sequence[slice]) -> tuple:
        """The index into the stored tensor of ``tensor[inner]`` (``inner``: one slice per
        dimension of the canonical tensor; with ``transposed``, what it reads is
        ``tensor[inner]`` transposed)."""
        out, inner = [], list(inner)
        if self.transposed:
            inner = [inner[-1], *inner[:-1]]
        for item in self.index:
            if isinstance(item, int):
                out.append(item)
            else:
                s = inner.pop(0)
                out.append(slice(item.start + s.start, item.start + s.stop))
        return tuple(out + inner)


@dataclass(frozen=True)
class Layouts:
    renames: tuple[Renamed, ...] = ()
    fused: tuple[FusedExperts, ...] = ()

    def _stored_names(self, key: str) -> list[str]:
        names = [key]
        for r in self.renames:
            if key.startswith(r.canonical):
                names.append(r.stored + key[len(r.canonical):])
        return names

    def resolve(self, key: str, shapes: Mapping[str, Sequence[int]],
                want: Optional[Sequence[int]] = None) -> Optional[Resolved]:
        """Where the canonical tensor ``key`` is in a checkpoint whose tensors have ``shapes``.
        Where one fused name has two layouts (transformers' and the transposed published one),
        ``want``, the canonical shape, tells them apart; where both fit, the first rule's (not
        transposed), as transformers reads such a tensor."""
        for name in self._stored_names(key):
            if name in shapes:
                return Resolved(name, (), tuple(shapes[name]))
            found = []
            for rule in self.fused:
                fused = rule.to_fused(name)
                if fused is None or fused[0] not in shapes:
                    continue
                fused_key, expert, part = fused
                where = rule.locate(shapes[fused_key], expert, part)
                if where is not None:
                    found.append(dataclasses.replace(where, stored=fused_key))
            if want is not None and len(found) > 1:
                # Where both fit (square experts), the stored one is read as it is, as
                # transformers reads it (its transpose checks the shape first).
                found = [f for f in found if f.shape == tuple(want)]
            if found:
                return found[0]
        return None

    def fused_rule(self, key: str, shape: Sequence[int]) -> Optional[FusedExperts]:
        """The rule of a tensor named as transformers holds it in memory, when it is fused."""
        return next((rule for rule in self.fused if rule.from_fused(key, shape) is not None),
                    None)

    def canonical(self, key: str, shape: Sequence[int]) -> list[tuple[str, tuple]]:
        """The canonical (key, shape) pairs of a tensor named as transformers holds it in memory
        (fused experts, renamed prefix): the inverse of :meth:`resolve`."""
        for r in self.renames:
            if key.startswith(r.stored):
                key = r.canonical + key[len(r.stored):]
                break
        for rule in self.fused:
            parts = rule.from_fused(key, shape)
            if parts is not None:
                return parts
        return [(key, tuple(shape))]
