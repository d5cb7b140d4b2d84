"""Megatron-Core's private names that megatron_slmoe uses outside the patch registry."""

from __future__ import annotations

from megatron.core.datasets.indexed_dataset import _INDEX_HEADER as INDEX_HEADER
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.transformer.moe.router import TopKRouter

from megatron_slmoe.compat import moved

TESTED = "0.16.1"
_RESULTS_QUEUE = "_results_queue"


def write_results_queue():
    """The queue Megatron's checkpoint shard writers send their results to; None until made."""
    if not hasattr(filesystem_async, _RESULTS_QUEUE):
        raise moved("megatron-core", f"{filesystem_async.__name__}.{_RESULTS_QUEUE}", TESTED)
    return getattr(filesystem_async, _RESULTS_QUEUE)


def set_write_results_queue(queue) -> None:
    """Make ``queue`` the shard writers' results queue (Megatron would start a manager of its own,
    which outlives its trainer)."""
    write_results_queue()  # still where it was
    setattr(filesystem_async, _RESULTS_QUEUE, queue)


def apply_expert_bias(router: TopKRouter, routing_map, padding_mask=None) -> None:
    """Megatron's expert-bias update of one routing (looked up per call: on CPU the patch
    registry replaces it with its uncompiled self)."""
    TopKRouter._apply_expert_bias(router, routing_map, padding_mask=padding_mask)


def defer_expert_bias(router_class: type) -> type:
    """Class decorator for a TopKRouter subclass that calls ``apply_expert_bias`` itself:
    ``TopKRouter.routing`` updates the bias inside (through ``_apply_expert_bias``), which the
    subclass turns into nothing."""
    if not issubclass(router_class, TopKRouter) or not hasattr(TopKRouter, "_apply_expert_bias"):
        raise moved("megatron-core", "TopKRouter._apply_expert_bias", TESTED)

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        pass  # deferred: the subclass calls apply_expert_bias

    router_class._apply_expert_bias = _apply_expert_bias
    return router_class


_LANGUAGE_MAX_SEQUENCE_LENGTH = "_language_max_sequence_length"


def llava_padded_length(model) -> int:
    """The sequence length a pipeline-parallel LLaVAModel pads its combined (text + image)
    sequence to when it runs without an inference context: what the next stage receives."""
    if not hasattr(model, _LANGUAGE_MAX_SEQUENCE_LENGTH):
        raise moved("megatron-core", f"LLaVAModel.{_LANGUAGE_MAX_SEQUENCE_LENGTH}", TESTED)
    return int(getattr(model, _LANGUAGE_MAX_SEQUENCE_LENGTH))


__all__ = ["INDEX_HEADER", "apply_expert_bias", "defer_expert_bias", "llava_padded_length",
           "set_write_results_queue", "write_results_queue"]
