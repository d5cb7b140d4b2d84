"""Whether a number of ranks can be laid out as tensor x pipeline x data parallelism with expert
parallelism dividing the ranks of a pipeline stage, and whether a global batch splits evenly over
the data-parallel ranks: the one place these rules live (the run's checks, the planner's
candidates and its checklist, the data sampler, ``slmoe-generate``). Torch-free."""

from __future__ import annotations

from typing import Optional

from megatron_slmoe.config.errors import ConfigError


def layout_problem(world_size: int, tp: int, pp: int, ep: int) -> Optional[str]:
    """Why ``world_size`` ranks do not fit TP x PP with EP dividing a stage's ranks (one line
    naming the flags), or None when they do."""
    if world_size % (tp * pp):
        return (f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} "
                f"x --pipeline-model-parallel-size {pp}")
    stage_ranks = world_size // pp  # data x tensor parallel ranks of one pipeline stage
    if stage_ranks % ep:
        return (f"--expert-model-parallel-size {ep} must divide the {stage_ranks} ranks of a "
                f"pipeline stage (world {world_size} / PP {pp})")
    return None


def data_parallel_size(world_size: int, tp: int, pp: int, ep: int) -> int:
    """The data-parallel size of a layout that fits; ConfigError naming the flags otherwise."""
    problem = layout_problem(world_size, tp, pp, ep)
    if problem:
        raise ConfigError(problem)
    return world_size // (tp * pp)


def batch_split_problem(global_batch_size: int, data_parallel_size: int,
                        micro_batch_size: Optional[int] = None) -> Optional[str]:
    """Why a global batch does not split into equal shares of whole micro-batches over the
    data-parallel ranks (one line naming the flags), or None when it does. Without
    ``micro_batch_size``: only the equal shares."""
    micro = 1 if micro_batch_size is None else micro_batch_size
    if micro < 1:
        return f"--micro-batch-size must be positive, got {micro_batch_size}"
    if data_parallel_size < 1:
        return f"data-parallel size must be positive, got {data_parallel_size}"
    if global_batch_size % (micro * data_parallel_size) == 0:
        return None
    if micro_batch_size is None:
        return (f"--global-batch-size {global_batch_size} is not divisible by data-parallel size "
                f"{data_parallel_size}")
    return (f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
            f"{micro_batch_size} x data-parallel size {data_parallel_size}")
