"""The test process adapts Megatron-Core to this machine once, as every entry point of the package
does (importing megatron_slmoe applies nothing by itself); the tiny base checkpoint is made once
per session for every multi-process test module that fine-tunes from one."""

import pytest

from megatron_slmoe.platform import apply_adaptor
from tests.helpers.entry_point import make_tiny_base

apply_adaptor()


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A tiny base checkpoint (one full-training step of the tiny model on the shipped corpus),
    shared by the tests of this session that LoRA-tune from a trained base."""
    return make_tiny_base(tmp_path_factory.mktemp("tiny-base"))
