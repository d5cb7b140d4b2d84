"""megatron_slmoe: LoRA fine-tuning of Stable Latent MoE models on Megatron-Core.

Importing the package (or any module of it) defines things and does nothing else: no torch import
here, no patch applied. What adapts Megatron-Core to the device is one explicit call,
``megatron_slmoe.platform.apply_adaptor()``, which every entry point and model builder of the
package makes (idempotent; call it yourself before building Megatron-Core modules of your own).
``megatron_slmoe.PLATFORM`` makes the same call on first use and gives the detected platform.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "PLATFORM":  # applied on first use, so that importing the package stays free
        from megatron_slmoe.platform import apply_adaptor

        return apply_adaptor()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
