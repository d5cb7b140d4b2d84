#!/usr/bin/env python
"""Fold a LoRA adapter into its base model and save the merged model as a Megatron dist checkpoint. (``slmoe-merge-lora``; see megatron_slmoe.commands.merge_lora)."""

import sys

from megatron_slmoe.commands.merge_lora import main

if __name__ == "__main__":
    sys.exit(main())
