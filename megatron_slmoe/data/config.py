"""The data sections: training and held-out data with the tokenizer, and the images of
--task image-text. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_slmoe.config.schema import Section, setting
from megatron_slmoe.storage.config import check_locations


@dataclass(frozen=True)
class DataConfig(Section):
    """Training and held-out data, and the tokenizer."""

    section_name = "data"

    task: Literal["text", "image-text"] = setting(
        "text", flag="--task",
        help="image-text: the multimodal model (a vision tower and projector before this language "
             "model, see the vision and image_text sections) on energon image-text datasets "
             "(default data: the synthetic shapes task; captions with --data-format pretrain)")
    format: Literal["instruction", "pretrain"] = setting(
        "instruction", flag="--data-format",
        help="instruction JSON lines, or a Megatron indexed dataset for pretraining")
    train_data: Optional[str] = setting(
        None, flag="--train-data",
        help="instruction JSONL, an indexed dataset prefix, or an energon dataset folder for "
             "--task image-text (default: the shipped demo data); instruction and pretraining "
             "data may be an s3:// / msc:// URL, where one ending in '/' means every *.jsonl (or "
             "every *.idx/*.bin pair) under it, in key order")
    valid_data: Optional[str] = setting(
        None, flag="--valid-data",
        help="held-out data, a path or URL as --train-data (needed with instruction --train-data: "
             "the shipped demo set is no measure of your task; pretraining data holds out 5%% of "
             "its documents instead)")
    tokenizer: Optional[str] = setting(
        None, flag="--tokenizer",
        help="tokenizer.json (a path or an s3:// / msc:// URL), or a Hugging Face checkpoint "
             "directory (tokenizer.json with the special tokens and chat template of "
             "tokenizer_config.json) (default: the --hf-checkpoint's, else the shipped one)")
    seq_length: int = setting(128, flag="--seq-length", help="tokens per sample")
    max_malformed_fraction: float = setting(
        0.1, flag="--max-malformed-fraction",
        help="stop when more than this share of an instruction file's records is malformed "
             "(they are skipped and counted up to it)")

    def validate(self) -> None:
        self.check_positive("seq_length")
        check_locations(self, "train_data", "valid_data", "tokenizer")
        self.check(0.0 <= self.max_malformed_fraction < 1.0, "max_malformed_fraction",
                   f"must be in [0, 1), got {self.max_malformed_fraction}")


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_TOKEN = "<image>"
"""Where an image goes in the text of an image-text sample."""
VIDEO_TOKEN = "<video>"
"""Where a video clip goes in the text of a sample (ms-swift's and LLaMA-Factory's mark)."""


@dataclass(frozen=True)
class ImageTextConfig(Section):
    """Images and evaluation of --task image-text."""

    section_name = "image_text"

    max_tiles: int = setting(1, flag="--max-num-tiles",
                             help="tiles per image (1: the whole image resized; more: tiled by "
                                  "aspect ratio)")
    thumbnail: bool = setting(False, flag="--use-thumbnail",
                              help="with tiling, add the whole image as one more tile")
    image_mean: list[float] = setting(default_factory=lambda: list(CLIP_MEAN),
                                      flag="--image-mean",
                                      help="per-channel normalisation mean (3 numbers)")
    image_std: list[float] = setting(default_factory=lambda: list(CLIP_STD), flag="--image-std",
                                     help="per-channel normalisation standard deviation")
    train_vision_tower: bool = setting(
        False, flag="--train-vision-tower",
        help="with --finetune-mode full, train the vision tower too (by default it stays as "
             "built or loaded, as in LLaVA's recipes; the projector and language model train)")
    caption_prompt: str = setting(f"{IMAGE_TOKEN}\nDescribe the image.", flag="--caption-prompt",
                                  help="the user turn of captioning samples")
    eval_answers: int = setting(
        128, flag="--eval-answers",
        help="held-out prompts answered by greedy generation for the exact-match answer "
             "accuracy before and after training (0: none)")
    max_answer_tokens: int = setting(8, flag="--max-answer-tokens",
                                     help="most tokens generated per answer")

    def validate(self) -> None:
        self.check_positive("max_tiles", "max_answer_tokens")
        self.check_non_negative("eval_answers")
        self.check(not self.thumbnail or self.max_tiles > 1, "thumbnail",
                   "needs --max-num-tiles > 1")
        for name in ("image_mean", "image_std"):
            self.check(len(getattr(self, name)) == 3, name,
                       f"must be 3 numbers (R G B), got {getattr(self, name)}")
        self.check(min(self.image_std) > 0, "image_std",
                   f"must be positive, got {self.image_std}")
        self.check(IMAGE_TOKEN in self.caption_prompt, "caption_prompt",
                   f"must contain {IMAGE_TOKEN}, got {self.caption_prompt!r}")
