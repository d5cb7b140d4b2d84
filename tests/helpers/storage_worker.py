"""A process that reads objects through the node cache, as a rank does; for tests and benchmarks.

    python -m tests.helpers.storage_worker '{"cache_dir": ..., "urls": [...], ...}'

prints one JSON line: ``{"sha256": {url: digest}, "stats": {...}}``. The storage package needs
neither torch nor Megatron, so the worker loads it without running ``megatron_slmoe/__init__``
(the platform adaptor imports torch): a worker then starts in about a second instead of ten.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_storage_only() -> None:
    """Make ``import megatron_slmoe.storage`` skip the parent package's platform set-up."""
    if "megatron_slmoe" not in sys.modules:
        package = types.ModuleType("megatron_slmoe")
        package.__path__ = [os.path.join(REPO, "megatron_slmoe")]
        sys.modules["megatron_slmoe"] = package


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    import_storage_only()
    from megatron_slmoe.storage.config import StorageConfig
    from megatron_slmoe.storage import Storage

    storage = Storage(StorageConfig(cache_dir=spec["cache_dir"],
                                    cache_max_gb=spec.get("cache_max_gb", 1.0),
                                    cache_revalidate_seconds=spec.get("revalidate_s", 60.0),
                                    prefetch_shards=spec.get("prefetch", 2),
                                    retry_timeout_seconds=spec.get("retry_timeout_s", 60.0)))
    start_at = spec.get("start_at")  # wall-clock time: the ranks of a test start together
    if start_at:
        time.sleep(max(0.0, start_at - time.time()))
    digests = {}
    for url, path in zip(spec["urls"], storage.local_files(spec["urls"])):
        with open(path, "rb") as f:
            digests[url] = hashlib.sha256(f.read()).hexdigest()
    print(json.dumps({"sha256": digests, "stats": storage.cache.stats.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
