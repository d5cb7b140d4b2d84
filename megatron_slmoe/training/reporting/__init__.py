"""What a run tells, each with its callback: its first words (``announce``: ``config.yaml`` and
the start-up line), its records (``metrics``: metrics.jsonl and TensorBoard), the progress line
(``progress``), ``summary.json`` (``summary``) and the pictures drawn from them (``plots``)."""
