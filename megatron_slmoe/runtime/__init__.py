"""Running a model: process groups, the model on this rank, its base weights and adapter
(``runtime.model``), shared by the fine-tuning engine and the commands."""
