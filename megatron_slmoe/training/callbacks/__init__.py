"""The callback protocol (``callbacks.base``) and the concerns of a run that have no package of
their own: routing quality (``routing``), the adapter and base exports (``outputs``), mirroring to
object storage (``mirror``). Reliability (``training.reliability``), reporting
(``training.reporting``) and held-out accuracy (``training.tasks.accuracy``) keep their callbacks
beside their concern; ``training.recipe.CALLBACKS`` lists a run's callbacks in the order they are
called."""
