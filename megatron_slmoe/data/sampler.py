"""Deterministic, resumable global batches over a map-style dataset.

The training loop asks :class:`GlobalBatchSampler` for the next global batch: ``range(start, start +
global_batch_size)`` of sample indices, in order, with ``start`` = the samples consumed so far. The
randomness lives in the dataset (``InstructionDataset``, Megatron's ``GPTDataset``: sample ``i`` is
already a shuffled draw), so the position alone says where a run is: save ``state_dict()`` with the
checkpoint, ``load_state_dict()`` on resume, and the run continues with the very next sample.

Each data-parallel rank takes its contiguous slice of the global batch and splits it into micro
batches (:func:`micro_batches`), like Megatron's ``MegatronPretrainingSampler``; :func:`collate`
stacks the samples of one micro batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import torch

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.parallel.layout import batch_split_problem


class GlobalBatchSampler:
    """Global batches ``range(consumed, consumed + global_batch_size)`` until ``num_samples``.

    A partial last batch is dropped. ``consumed_samples`` advances as each batch is handed out, so
    ``state_dict()`` taken after training on a batch points at the next one.
    """

    def __init__(self, num_samples: int, global_batch_size: int, consumed_samples: int = 0):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if num_samples < 0:
            raise DataError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.consumed_samples = 0
        self.load_state_dict({"consumed_samples": consumed_samples})

    def __iter__(self) -> Iterator[range]:
        while self.consumed_samples + self.global_batch_size <= self.num_samples:
            start = self.consumed_samples
            self.consumed_samples += self.global_batch_size
            yield range(start, start + self.global_batch_size)

    def __len__(self) -> int:
        """Global batches still to come."""
        return max(0, (self.num_samples - self.consumed_samples) // self.global_batch_size)

    def state_dict(self) -> Dict[str, int]:
        return {"consumed_samples": self.consumed_samples,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue at ``state["consumed_samples"]`` (a changed global batch size is allowed: the
        position is counted in samples)."""
        consumed = int(state["consumed_samples"])
        if not 0 <= consumed <= self.num_samples:
            raise DataError(f"consumed_samples {consumed} outside the dataset's "
                            f"{self.num_samples} samples")
        self.consumed_samples = consumed


def rank_share(global_batch: range, data_parallel_rank: int = 0,
               data_parallel_size: int = 1) -> range:
    """The samples of a global batch that one data-parallel rank reads: its contiguous share
    ``global_batch_size / data_parallel_size``."""
    if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
        raise DataError(f"bad data-parallel rank {data_parallel_rank} of {data_parallel_size}")
    share = len(global_batch) // data_parallel_size
    start = global_batch.start + data_parallel_rank * share
    return range(start, start + share)


def micro_batches(global_batch: range, micro_batch_size: int, data_parallel_rank: int = 0,
                  data_parallel_size: int = 1) -> List[range]:
    """This rank's micro batches of a global batch: its :func:`rank_share`, cut into
    ``micro_batch_size`` pieces."""
    problem = batch_split_problem(len(global_batch), max(data_parallel_size, 1), micro_batch_size)
    if problem:
        raise DataError(problem)
    mine = rank_share(global_batch, data_parallel_rank, data_parallel_size)
    return [range(s, s + micro_batch_size)
            for s in range(mine.start, mine.stop, micro_batch_size)]


@dataclass(frozen=True)
class RankReads:
    """The positions one data-parallel rank reads of a dataset: its :func:`rank_share` of each
    global batch, the batches back to back from ``origin`` (0, or where a resumed run with
    another global batch size went on)."""

    global_batch_size: int
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    origin: int = 0

    def __post_init__(self):
        rank_share(range(self.global_batch_size), self.data_parallel_rank,
                   self.data_parallel_size)  # a bad rank is refused there
        problem = batch_split_problem(self.global_batch_size, self.data_parallel_size)
        if problem:
            raise DataError(problem)

    def mine(self, position: int) -> bool:
        window = self._window(position)
        return position in rank_share(window, self.data_parallel_rank, self.data_parallel_size)

    def after(self, position: int) -> Iterator[int]:
        """This rank's positions after ``position``, in order (endless)."""
        window = self._window(position + 1)
        while True:
            for p in rank_share(window, self.data_parallel_rank, self.data_parallel_size):
                if p > position:
                    yield p
            window = range(window.stop, window.stop + self.global_batch_size)

    def aligned_to(self, position: int) -> "RankReads":
        """These reads with ``position`` the first of this rank's share of a batch (to follow
        a run that read ``position`` while it is none of this rank's positions)."""
        first = rank_share(range(self.global_batch_size), self.data_parallel_rank,
                           self.data_parallel_size).start
        return dataclasses.replace(self, origin=(position - first) % self.global_batch_size)

    def _window(self, position: int) -> range:
        start = position - (position - self.origin) % self.global_batch_size
        return range(start, start + self.global_batch_size)


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack a list of sample dicts into a batch dict (each tensor gets a leading batch dim)."""
    if not samples:
        raise DataError("collate: no samples")
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def rank_batches(dataset, sampler: GlobalBatchSampler, micro_batch_size: int,
                 data_parallel_rank: int = 0,
                 data_parallel_size: int = 1) -> Iterator[List[Dict[str, torch.Tensor]]]:
    """For each global batch of ``sampler``: this rank's list of collated micro batches."""
    for global_batch in sampler:
        yield [collate([dataset[i] for i in mb])
               for mb in micro_batches(global_batch, micro_batch_size, data_parallel_rank,
                                       data_parallel_size)]


class ReadAhead:
    """Which positions to offer for fetching in the background as a reader reads: its next
    ``limit`` positions (``reads``' when given, else every position) below ``num_samples``, each
    offered until it is taken.

    A read that is none of ``reads``' positions (a resumed run with another global batch size,
    an evaluation wrapping around its dataset) realigns the batches at it and offers afresh."""

    def __init__(self, reads: Optional[RankReads], limit: int, num_samples: int):
        self.reads, self.limit, self.num_samples = reads, int(limit), int(num_samples)
        self._offered_until = 0  # positions before it are offered and taken (or read)
        self._last_read = -1

    def offer(self, read: int) -> List[int]:
        """The positions to offer now that ``read`` is being read, in read order."""
        if read < self._last_read:  # read again from the start (an evaluation): offer again
            self._offered_until = 0
        self._last_read = read
        if self.reads is None:
            ahead: Iterable[int] = range(read + 1, self.num_samples)
        else:
            if not self.reads.mine(read):
                self.reads = self.reads.aligned_to(read)
                self._offered_until = 0  # what was offered followed the old alignment
            ahead = itertools.takewhile(lambda p: p < self.num_samples, self.reads.after(read))
        return [p for p in itertools.islice(ahead, self.limit) if p >= self._offered_until]

    def taken(self, offered: List[int], count: int) -> None:
        """The first ``count`` of ``offered`` are fetched or on their way."""
        if count:
            self._offered_until = offered[count - 1] + 1
