"""The project's command-line programs, one module each with ``main(argv) -> exit code``.

``setup.py`` installs them as console scripts (``slmoe-finetune``, ``slmoe-merge-lora``,
``slmoe-convert-hf``, ``slmoe-count-params``, ``slmoe-preprocess-data``, ``slmoe-train-tokenizer``,
``slmoe-preflight``, ``slmoe-netcheck``); the scripts under ``tools/`` are thin wrappers of the same functions. Bad
input is one line on stderr and exit code 2.
"""
