"""Write the weights of a built Megatron model, in any TP/PP/EP layout, as a Hugging Face
checkpoint of its family: the inverse of ``loader.load_hf_weights``.

Every rank knows the same list of HF weights (transformers' model of the base ``config.json`` on
the meta device, in ``save_pretrained``'s per-expert names) and, from Megatron's own
``sharded_state_dict``, which boxes of which global Megatron tensors it holds; the mapping
table's pieces say where each box lands in the HF weights (``Overlap.to_hf``). Weight by weight,
every rank sends its blocks of that weight to rank 0 (one object gather), which assembles it,
checks every element arrived, and streams it into the shard files. Rank 0 holds one HF weight at a
time; the others hold nothing beyond their own shard.
"""

from __future__ import annotations

import math
import os

import torch

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.hf.loader import HFModel, local_box, sharded_tensors
from megatron_slmoe.hf.merged_export import hf_weights, write_hf_checkpoint
from megatron_slmoe.hf.safetensors_stream import PlannedTensor


def _local_blocks(model_chunks, hf: HFModel) -> dict[str, list]:
    """HF weight -> [(index into it, block)] of everything this rank holds."""
    table = hf.family.table(hf.model_config)
    blocks: dict[str, list] = {}
    for chunk in model_chunks:
        for st in sharded_tensors(chunk.sharded_state_dict()):
            pieces = table.pieces(st.key, tuple(st.global_shape))
            if pieces is None:
                continue  # not a base weight of the HF model (a LoRA factor)
            box = local_box(st)
            for piece in pieces:
                overlap = piece.within(box)
                if overlap is not None:
                    block = overlap.to_hf(st.data.detach()).to("cpu", copy=True)
                    index = tuple((s.start, s.stop) for s in overlap.hf_index)
                    blocks.setdefault(piece.hf_key, []).append((index, block))
    return blocks


def export_megatron_weights(model_chunks, hf: HFModel, output: str,
                            max_shard_bytes: int = 5 * 2**30) -> str:
    """Collective over all ranks: write the base weights of ``model_chunks`` (this rank's
    Megatron modules, built from ``hf.model_config``) as an HF checkpoint directory ``output``
    (new or empty; rank 0 writes it, staged). Returns its absolute path on every rank."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    dist = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    rank = torch.distributed.get_rank() if dist else 0
    blocks = _local_blocks(model_chunks, hf)
    dtypes = {key: found[0][1].dtype for key, found in blocks.items()}
    if dist:
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, dtypes)
        for other in every:
            for key, dtype in other.items():
                dtypes.setdefault(key, dtype)

    def gather(key: str, shape: tuple, dtype: torch.dtype):
        mine = blocks.pop(key, [])
        if dist:
            received = [None] * torch.distributed.get_world_size() if rank == 0 else None
            torch.distributed.gather_object(mine, received, dst=0)
            if rank != 0:
                return None
            mine = [b for part in received for b in part]
        tensor = torch.empty(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.bool)
        for index, block in mine:
            where = tuple(slice(a, b) for a, b in index)
            tensor[where] = block
            covered[where] = True
        if not bool(covered.all()):
            raise HFCheckpointError(f"{key}: {int((~covered).sum())} of {math.prod(shape)} "
                                    f"elements are held by no rank")
        return tensor

    planned = []
    for key, shape in hf_weights(hf):
        if key not in dtypes:
            raise HFCheckpointError(f"{key}: no rank's model holds any part of it")
        planned.append(PlannedTensor(key, dtypes[key], tuple(shape),
                                     lambda key=key, shape=shape: gather(key, shape, dtypes[key])))
    output = os.path.abspath(output)
    error = None
    if rank == 0:
        try:
            write_hf_checkpoint(output, planned, hf.checkpoint, max_shard_bytes)
        except (OSError, ValueError) as err:
            error = str(err)
    else:
        for tensor in planned:  # the same gathers, in the same order, as rank 0's writes
            tensor.produce()
    if dist:
        status = [error]
        torch.distributed.broadcast_object_list(status, src=0)
        error = status[0]
    if error:
        raise HFCheckpointError(error)
    return output
