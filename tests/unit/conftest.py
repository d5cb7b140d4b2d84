from datetime import timedelta

import pytest


@pytest.fixture(scope="session")
def megatron_single_rank():
    """Megatron's parallel_state for one rank in this process, initialised once."""
    from megatron_slmoe.platform.single_rank import init_single_rank

    init_single_rank(timeout=timedelta(seconds=60))
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
    # The aux-loss backward scale is a class attribute too: a backward outside a pipeline schedule
    # creates it 0-d, and a schedule then copies its 1-element scale into it and fails. Whatever
    # ran first must not decide that for the next test (test order varies under xdist).
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
