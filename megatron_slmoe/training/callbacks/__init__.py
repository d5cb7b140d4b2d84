"""The concerns of a training run besides its loop, each a ``Callback`` (``callbacks.base``):
progress line, stragglers, hang detection, routing quality, held-out answers, exports, the
summary, mirroring to object storage and the attempt record. ``training.engine.build_callbacks``
lists a run's callbacks in the order they are called."""
