"""The one place where the planner names modules outside ``megatron_slmoe.plan``.

The model configs (``megatron_slmoe.moe.model_config``) and the all-to-all dispatcher
(``megatron_slmoe.moe.alltoall``) are moving (to ``megatron_slmoe.model`` and
``megatron_slmoe.moe.dispatch``); when they do, only these imports change.
"""

from __future__ import annotations

from megatron_slmoe.moe.alltoall import flat_traffic_rows, hierarchical_traffic_rows
from megatron_slmoe.moe.model_config import ModelConfig, load_model_config
from megatron_slmoe.moe.validation import ConfigError

__all__ = ["ConfigError", "ModelConfig", "flat_traffic_rows", "hierarchical_traffic_rows",
           "load_model_config"]
