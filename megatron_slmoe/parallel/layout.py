"""Whether a number of ranks can be laid out as tensor x pipeline x data parallelism with expert
parallelism dividing the ranks of a pipeline stage: the one place this rule lives (the run's
checks, the planner's candidates and its checklist, ``slmoe-generate``). Torch-free."""

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
