"""Instruction conversations in a model's own Jinja chat template (Hugging Face tokenizers).

The template is rendered by transformers' renderer (its sandbox and helpers, so the text is
exactly what ``apply_chat_template`` gives) and the whole text is tokenized at once. Targets are
the tokens that start inside an assistant turn's answer: the text between the generation prompt
(``render(messages[:i], add_generation_prompt=True)``) and the end of the turn
(``render(messages[:i + 1])``), so the answer and the template's end-of-turn tokens are learnt and
the role headers are context. A template whose earlier turns change when a later one is added
(e.g. one that drops past reasoning) has no such spans: that is one DataError line.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from megatron_slmoe.data.errors import DataError


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # pragma: no cover - install problem
        raise DataError("a tokenizer with a chat template needs transformers "
                        "(pip install 'megatron-slmoe[hf]')") from None
    special = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
               "bos_token": tokenizer.bos_token}
    try:
        rendered, _ = render_jinja_template(conversations=[list(messages)],
                                            chat_template=tokenizer.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{k: v for k, v in special.items() if v})
    except Exception as err:  # jinja2's TemplateError, or raise_exception() in the template
        raise DataError(f"{tokenizer.path}: chat template failed: "
                        f"{' '.join(str(err).split())[:200]}") from None
    return rendered[0]


def render_chat(tokenizer, messages: Sequence[dict]) -> Tuple[List[int], List[int]]:
    """(token ids, target flags) of one conversation in the tokenizer's chat template."""
    text = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        turn = render(tokenizer, messages[:i + 1])
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise DataError(f"{tokenizer.path}: the chat template renders earlier turns "
                            f"differently once later ones follow; answer spans are undefined")
        spans.append((len(prompt), len(turn)))
    ids, offsets = tokenizer.encode_with_offsets(text, allow_special=True)
    targets = [int(any(a <= start < b for a, b in spans)) for start, _ in offsets]
    return ids, targets


def generation_prompt(tokenizer, messages: Sequence[dict]) -> List[int]:
    """Token ids asking the model for the next assistant turn."""
    return tokenizer.encode(render(tokenizer, messages, add_generation_prompt=True),
                            allow_special=True)
