"""The training system on Megatron-Core: the run configuration and its command line, the engine
(set-up, step, evaluate, save, finish), its tasks and callbacks, checkpoints and start-up checks.
``python -m megatron_slmoe.training.finetune`` is the entry point."""
