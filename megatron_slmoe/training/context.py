"""The run's context: the engine's objects and progress as callbacks and tasks see them (the
engine fills it in at set-up and advances ``iteration`` / ``consumed_samples``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("megatron_slmoe.training")


@dataclass
class RunContext:
    """The engine's objects and progress, as callbacks and tasks see them.

    ``forward_only(microbatches)`` runs micro-batches forward through the model's pipeline
    schedule (collective) and returns the mean loss; ``microbatches(dataset, start)`` is this
    rank's share of the global batch of samples ``[start, start + global batch)``;
    ``stop(reason)`` tells every callback that the run is ending for ``reason`` (from any thread).
    """

    platform: Any
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    output_dir: str
    train_iters: int
    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    model: Any                    # this rank's model chunk (LoRA injected)
    ddp: Any                      # the chunk in Megatron's DDP
    transformer_config: Any       # Megatron's TransformerConfig of the model
    model_config: Any             # our ModelConfig (name, SLMoE settings)
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    hf: Any                       # the opened Hugging Face checkpoint (hf.HFModel), or None
    train: Any                    # datasets: sample i -> sample
    valid: Any
    storage: Any                  # megatron_slmoe.storage.Storage
    records: Any                  # RecordSink: metrics.jsonl and TensorBoard (rank 0 writes)
    forward_only: Callable[[list], float]
    microbatches: Callable[[Any, int], list]
    stop: Callable[[str], None]
    iteration: int = 0
    consumed_samples: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def device(self):
        return self.platform.device()

    def info(self, message: str) -> None:
        """A line of the run's log (rank 0 writes it)."""
        if self.rank == 0:
            log.info(message)
