"""Every private name of another library that megatron_slmoe uses (``compat``) exists in the
installed version and does what we rely on; a release that moves one fails here, and where the
package reads it the error is one line naming the installed version."""

import inspect
import re
from importlib.metadata import version

import pytest
import torch

from megatron_slmoe.compat import CompatError


def test_torch_names():
    from megatron_slmoe.compat import torch as compat

    assert torch.empty in compat.device_constructors() and torch.zeros in compat.device_constructors()
    assert compat.has_kernel_for_dispatch_key("aten::add.Tensor", "CPU")
    assert not compat.has_kernel_for_dispatch_key("aten::add.Tensor", "PrivateUse1")
    leaves, _ = compat.tree_flatten({"a": [torch.ones(1), 2]})
    assert len(leaves) == 2
    assert issubclass(compat.TorchDispatchMode, object) and hasattr(compat.TorchDispatchMode,
                                                                    "__torch_dispatch__")


def test_uncompiled_returns_the_function_torch_compile_wraps():
    from megatron_slmoe.compat.torch import uncompiled

    def f(x):
        return x + 1

    assert uncompiled(torch.compile(f)) is f
    with pytest.raises(CompatError, match="has no _torchdynamo_orig_callable: it is not "
                                          f"torch.compile'd, or torch {re.escape(version('torch'))}"):
        uncompiled(f)


def test_megatron_names():
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_slmoe.compat import megatron as compat

    assert compat.INDEX_HEADER.startswith(b"MMIDIDX")
    assert compat.write_results_queue() is filesystem_async._results_queue
    # The deferred update must be the one routing() calls, with the arguments we pass.
    assert "self._apply_expert_bias(routing_map, padding_mask=padding_mask)" in inspect.getsource(
        TopKRouter.routing)
    assert list(inspect.signature(TopKRouter._apply_expert_bias).parameters)[:3] == [
        "self", "routing_map", "padding_mask"]
    # LLaVAModel pads between pipeline stages to this length (generation reads it).
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    source = inspect.getsource(LLaVAModel)
    assert "self._language_max_sequence_length = language_max_sequence_length" in source
    assert "max_seq_len = self._language_max_sequence_length" in source


def test_megatron_results_queue_moved_is_one_clear_error(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_slmoe.compat import megatron as compat

    monkeypatch.delattr(filesystem_async, "_results_queue")
    with pytest.raises(CompatError, match=f"megatron-core {re.escape(version('megatron-core'))} has no "
                                          r".*filesystem_async\._results_queue"):
        compat.set_write_results_queue(None)


def test_peft_moe_target_module_mapping():
    pytest.importorskip("peft")
    from megatron_slmoe.compat.peft import moe_target_module_mapping

    qwen = moe_target_module_mapping("qwen3_moe")
    assert qwen["gate_proj"] == "gate_up_proj" and qwen["down_proj"] == "down_proj"
    assert moe_target_module_mapping("nemotron_h") is None


def test_peft_mapping_moved_is_one_clear_error(monkeypatch):
    pytest.importorskip("peft")
    from peft.utils import transformers_weight_conversion

    from megatron_slmoe.compat.peft import moe_target_module_mapping

    monkeypatch.delattr(transformers_weight_conversion, "_MOE_TARGET_MODULE_MAPPING")
    with pytest.raises(CompatError, match=f"peft {re.escape(version('peft'))} has no "
                                          r".*_MOE_TARGET_MODULE_MAPPING"):
        moe_target_module_mapping("qwen3_moe")
