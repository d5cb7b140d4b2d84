import os
from datetime import timedelta

import pytest
import torch


@pytest.fixture(scope="session")
def megatron_single_rank():
    """Megatron's parallel_state for one rank (gloo) in this process, initialised once."""
    import megatron_slmoe  # noqa: F401  (applies the platform adaptor)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.distributed.harness import free_port

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group(megatron_slmoe.PLATFORM.backend, rank=0,
                                             world_size=1, timeout=timedelta(seconds=60))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def fresh_aux_loss_tracker():
    """Megatron keeps aux losses in a module-global tracker sized by the first model that logs
    one; tests build models of different depths in one process, so start each from empty."""
    yield
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    except ImportError:
        return
    get_moe_layer_wise_logging_tracker().clear()
