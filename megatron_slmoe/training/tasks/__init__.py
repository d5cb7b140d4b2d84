"""Tasks: what a kind of training data brings to the engine (``tasks.base.Task``): the language
model task (``tasks.text``) and the image-text task (``tasks.image_text``); the callback that
scores a task's held-out answers (``tasks.accuracy``)."""

from megatron_slmoe.training.tasks.image_text import ImageTextTask
from megatron_slmoe.training.tasks.text import TextTask


def build_task(run, hf=None):
    """The run's task; ``hf``: the opened HF checkpoint the run starts from, if any."""
    if run.data.task == "image-text":
        return ImageTextTask(run.data, run.vision, run.image_text, run.schedule,
                             run.model.finetune_mode, hf)
    return TextTask(run.data, run.schedule)
