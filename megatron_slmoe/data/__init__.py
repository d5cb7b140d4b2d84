"""Data: tokenizers, datasets (instruction JSONL, Megatron indexed pretraining data), shipped assets.

Modules:
    tokenizer    byte-level BPE tokenizers: ``load_tokenizer``, ``train_tokenizer``, ``Tokenizer``
    instruction  instruction JSONL -> chat template -> packed fixed-length samples
    pretrain     text -> Megatron ``.bin/.idx`` (``preprocess``) and GPT samples from them
    sampler      deterministic, resumable global batches
    synthetic    the generator of the shipped assets (``megatron_slmoe/assets/``)
    assets       paths of the shipped assets

Object storage (S3/MinIO/OBS, msc profiles) and the node-local cache are ``megatron_slmoe.storage``
(it serves checkpoints and outputs too); ``training/tasks/text.py`` resolves data URLs through it.
Nothing in this package downloads at run time. The settings are ``data.config`` (torch-free);
import from the modules themselves: the package imports nothing.
"""
