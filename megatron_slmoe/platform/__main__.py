"""``python -m megatron_slmoe.platform``: print the detected platform, backend, native kernels and
applied patches as one JSON object. Exit code 2, with one line on stderr, if the platform or
backend requested through the environment cannot be used."""

from __future__ import annotations

import importlib.util
import json
import sys

import torch

from megatron_slmoe.ops import native_kernels
from megatron_slmoe.platform import PlatformError, applied_patches, apply_adaptor


def main() -> int:
    try:
        platform = apply_adaptor()
    except PlatformError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = {
        "platform": platform.name,
        "backend": platform.backend,
        "device": str(platform.device()),
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core"),
        "megatron_slmoe": _version("megatron-slmoe"),
        "kernels": native_kernels(),
        # Megatron-Core's optional fused kernels (their absence warns at import; we quiet that)
        "optional_libraries": {name: importlib.util.find_spec(name) is not None
                               for name in ("transformer_engine", "apex")},
        "patches": applied_patches(),
    }
    print(json.dumps(report, indent=2))
    return 0


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
