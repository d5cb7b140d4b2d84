"""The tokenizer and chat template of a Hugging Face checkpoint directory: special tokens from
tokenizer_config.json, conversations rendered exactly as transformers' apply_chat_template renders
and tokenizes them, loss targets on the answers and their end-of-turn tokens only, and one-line
errors for unusable directories."""


import pytest

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.instruction import build_generation_prompt, render_chat
from megatron_slmoe.data.tokenizer import load_tokenizer
from tests.helpers import hf_models

MESSAGES = [{"role": "system", "content": "Answer in digits."},
            {"role": "user", "content": "two one"}, {"role": "assistant", "content": "2 1"},
            {"role": "user", "content": "nine"}, {"role": "assistant", "content": "9"}]


def test_chat_template_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    directory = hf_models.save_chatml_tokenizer(tmp_path / "tok")
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.eos_id == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.pad_id == tokenizer.token_to_id("<|endoftext|>")
    reference = AutoTokenizer.from_pretrained(str(directory))
    ids, targets = render_chat(tokenizer, MESSAGES)
    assert ids == list(reference.apply_chat_template(MESSAGES, tokenize=True,
                                                     return_dict=False))
    answers = [tokenizer.decode([i for i, t in zip(ids, targets) if t])]
    assert answers == ["2 1<|im_end|>\n9<|im_end|>\n"]
    prompt = build_generation_prompt(tokenizer, MESSAGES[:4])
    assert prompt == list(reference.apply_chat_template(
        MESSAGES[:4], tokenize=True, add_generation_prompt=True, return_dict=False))


def test_no_pad_token_pads_with_eos_and_jinja_file_wins(tmp_path):
    directory = hf_models.save_chatml_tokenizer(tmp_path / "tok", pad_token=None)
    (directory / "chat_template.jinja").write_text(hf_models.CHATML.replace("\\n", " "))
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.pad_id == tokenizer.eos_id
    assert "\n" not in tokenizer.decode(render_chat(tokenizer, MESSAGES)[0])


@pytest.mark.parametrize("config, message", [
    ({"eos_token": None}, "no eos_token"),
    ({"eos_token": "<|nope|>"}, "eos_token '<|nope|>' is not in"),
    ({"chat_template": "{{ raise_exception('no system role') }}"}, "chat template failed: no system"),
    ({"chat_template": "{% for m in messages[-1:] %}{{ m['content'] }}{% endfor %}"},
     "renders earlier turns differently"),
])
def test_bad_tokenizer_directory_is_one_line(tmp_path, config, message):
    directory = hf_models.save_chatml_tokenizer(tmp_path / "tok", **config)
    with pytest.raises(DataError) as err:
        render_chat(load_tokenizer(str(directory)), MESSAGES)
    assert message in str(err.value) and "\n" not in str(err.value)
