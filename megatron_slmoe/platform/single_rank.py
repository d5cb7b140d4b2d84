"""Megatron-Core's parallel state for one process alone (TP = PP = EP = 1): what the tools that
build a whole model in one process need (parameter census, merge, conversion) and the unit tests."""

from __future__ import annotations

from datetime import timedelta

import torch

from megatron_slmoe.platform import apply_adaptor


def init_single_rank(seed: int = 1234, timeout: timedelta = timedelta(minutes=10)) -> None:
    """A one-rank process group (its store in this process: not MASTER_ADDR/MASTER_PORT, which
    may belong to a parent job, nor a tcp:// address, which under torchrun joins the agent's
    store and waits there) and Megatron's parallel state without model parallelism, unless they
    exist already; then they must be a single process without model parallelism."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            apply_adaptor().backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
            timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(seed)
    sizes = {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "expert": parallel_state.get_expert_model_parallel_world_size(),
    }
    split = {kind: size for kind, size in sizes.items() if size != 1}
    if split:
        raise RuntimeError(f"parallel_state is already initialised with model parallelism {split}; "
                           f"the whole model needs a process without it")
