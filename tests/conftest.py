"""The test process adapts Megatron-Core to this machine once, as every entry point of the package
does (importing megatron_slmoe applies nothing by itself)."""

from megatron_slmoe.platform import apply_adaptor

apply_adaptor()
