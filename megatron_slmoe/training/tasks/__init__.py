"""Tasks: what a kind of training data brings to the engine (``tasks.base.Task``): the language
model task (``tasks.text``) and the image-text task (``tasks.image_text``)."""
