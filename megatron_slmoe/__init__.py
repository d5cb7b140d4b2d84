"""megatron_slmoe: LoRA fine-tuning of Stable Latent MoE models on Megatron-Core.

Importing the package (or any module of it) defines things and does one thing else: it ignores the
few warnings Megatron-Core prints about itself (``utils.upstream_noise``; they would bury a
command's one ``error:`` line, and a model config resolved while parsing flags imports Megatron
before any entry point could act). No torch import here, no patch applied. What adapts Megatron-Core to the device is one explicit call,
``megatron_slmoe.platform.apply_adaptor()``, which every entry point and model builder of the
package makes (idempotent; call it yourself before building Megatron-Core modules of your own).
``megatron_slmoe.PLATFORM`` makes the same call on first use and gives the detected platform.
"""

from megatron_slmoe.utils.upstream_noise import quiet_upstream_noise

__version__ = "0.1.0"

quiet_upstream_noise()


def __getattr__(name: str):
    if name == "PLATFORM":  # applied on first use, so that importing the package stays free
        from megatron_slmoe.platform import apply_adaptor

        return apply_adaptor()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
