"""Training on Megatron-Core. For now only the smoke run; the LoRA trainer arrives with its issue."""
