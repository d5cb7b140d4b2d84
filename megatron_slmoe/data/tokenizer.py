"""Byte-level BPE tokenizers (Hugging Face ``tokenizers``): load, train, and a small wrapper.

The wrapper speaks two dialects:

- ours: ``encode(text) -> list[int]``, ``decode(ids)``, ``vocab_size``, ``eos_id``, ``pad_id``,
  ``bos_id``, ``special_tokens`` (name -> id);
- the duck type Megatron-Core's datasets read from ``BlendedMegatronDatasetConfig.tokenizer``:
  ``vocab_size``, ``eod``, ``eos``, ``bos``, ``pad``, ``tokenize``, ``detokenize``, ``vocab``.

Special tokens. Every tokenizer trained here has the :data:`SPECIAL_TOKENS` at ids 0..5, in that
order (``<|pad|>`` = 0, ``<|eos|>`` = 1, ...). A loaded tokenizer must have at least ``<|pad|>`` and
``<|eos|>``; the role tokens are needed only for chat data (see ``data/instruction.py``).

``encode`` treats special-token text in its input as plain text: a data record that contains the
characters ``<|eos|>`` cannot forge an end-of-sequence token. Special token ids are placed by
the caller (``encode(..., allow_special=True)`` opts out).

Hugging Face checkpoint directories: ``load_tokenizer(DIR)`` reads ``DIR/tokenizer.json`` and the
special tokens and chat template of ``DIR/tokenizer_config.json`` (or ``chat_template.jinja``). Its
end-of-sequence token is the config's ``eos_token``, padding its ``pad_token`` (else the eos
token); instruction data is then rendered with the model's own chat template
(``data/chat_template.py``) instead of the role tokens above.

Nothing here downloads: a tokenizer is a local ``tokenizer.json`` file or checkpoint directory.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.errors import DataError, DataFileNotFoundError, require_file
from megatron_slmoe.utils.atomic import write_text_atomic

PAD = "<|pad|>"
EOS = "<|eos|>"
BOS = "<|bos|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"

#: Special tokens of a tokenizer trained by :func:`train_tokenizer`, at ids 0, 1, 2, ...
SPECIAL_TOKENS = (PAD, EOS, BOS, SYSTEM, USER, ASSISTANT)

#: Role name -> the token that opens a message of that role in the chat template.
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - install problem
        raise DataError(f"the `tokenizers` package is required ({exc}); pip install tokenizers") from None
    return tokenizers


class Tokenizer:
    """A loaded byte-level BPE tokenizer. Build it with :func:`load_tokenizer`.

    ``pad``, ``eos``, ``bos`` name the special tokens of those roles (ours by default; a Hugging
    Face directory's from its tokenizer_config.json); ``chat_template`` is a Jinja chat template
    or None (ours: the role-token template of ``data/instruction.py``)."""

    def __init__(self, backend, path: Optional[str] = None, pad: str = PAD, eos: str = EOS,
                 bos: Optional[str] = BOS, chat_template: Optional[str] = None):
        self._tk = backend
        self.path = path
        self._vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.special_tokens: Dict[str, int] = {}
        for added in backend.get_added_tokens_decoder().values():
            if added.special:
                self.special_tokens[added.content] = backend.token_to_id(added.content)
        where = path or "tokenizer"
        for required in (pad, eos):
            if required not in self.special_tokens:
                raise DataError(f"{where}: special token {required} missing "
                                f"(has {sorted(self.special_tokens)})")
        self.pad_token, self.eos_token, self.bos_token = pad, eos, bos
        self.pad_id = self.special_tokens[pad]
        self.eos_id = self.special_tokens[eos]
        self.bos_id = self.special_tokens.get(bos) if bos else None
        self.chat_template = chat_template

    # ---- ours ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (ids are 0 .. vocab_size-1)."""
        return self._vocab_size

    def encode(self, text: str, allow_special: bool = False) -> List[int]:
        """Token ids of ``text``; no special tokens are added. With ``allow_special`` the text of a
        special token (``"<|eos|>"``) becomes its id, otherwise it is encoded as plain bytes."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        self._tk.encode_special_tokens = not allow_special
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str, allow_special: bool = True):
        """(ids, character offsets ``(start, end)`` of each token) of ``text``."""
        self._tk.encode_special_tokens = not allow_special
        encoding = self._tk.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> List[List[int]]:
        self._tk.encode_special_tokens = not allow_special
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        """Id of a token (special or not); :class:`DataError` when the vocabulary lacks it."""
        tid = self._tk.token_to_id(token)
        if tid is None:
            raise DataError(f"{self.path or 'tokenizer'}: no token {token!r}")
        return tid

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tk.id_to_token(int(token_id))

    def role_id(self, role: str) -> int:
        """Id of the token that opens a chat message of ``role`` (system, user, assistant)."""
        if role not in ROLE_TOKENS:
            raise DataError(f"unknown chat role {role!r} (expected one of {sorted(ROLE_TOKENS)})")
        token = ROLE_TOKENS[role]
        if token not in self.special_tokens:
            raise DataError(f"{self.path or 'tokenizer'}: special token {token} missing; "
                            "chat data needs a tokenizer trained with the role tokens")
        return self.special_tokens[token]

    def save(self, path: str) -> None:
        write_text_atomic(path, self._tk.to_str(pretty=True) + "\n")

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the tokenizer's canonical serialisation: equal for the same vocabulary,
        merges and special tokens, whatever the file's formatting. Checkpoints and adapters
        record it so that a run with another tokenizer is refused."""
        import hashlib

        return hashlib.sha256(self._tk.to_str(pretty=False).encode("utf-8")).hexdigest()

    # ---- Megatron-Core duck type -----------------------------------------------------------------

    @property
    def eod(self) -> int:
        return self.eos_id

    @property
    def eos(self) -> int:
        return self.eos_id

    @property
    def bos(self) -> Optional[int]:
        return self.bos_id

    @property
    def pad(self) -> int:
        return self.pad_id

    @property
    def special_tokens_dict(self) -> Dict[str, int]:
        # Megatron's pad-collision check reads this (keys other than "pad_token" must differ from pad).
        names = {self.pad_token: "pad_token", self.eos_token: "eos_token",
                 self.bos_token: "bos_token"}
        return {names.get(tok, tok): tid for tok, tid in self.special_tokens.items()}

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        # Megatron's datasets put this in the description (and hash) of their index cache.
        import hashlib

        if getattr(self, "_digest", None) is None:
            self._digest = hashlib.sha256(self._tk.to_str().encode("utf-8")).hexdigest()[:16]
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}",
                "tokenizer_path": self.path, "vocab_size": self.vocab_size, "sha256": self._digest}

    def tokenize(self, text: str) -> List[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def _backend(path: str):
    path = require_file(path, "tokenizer file")
    tk = _tokenizers()
    try:
        return path, tk.Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a bare Exception with a multi-line serde message
        reason = " ".join(str(exc).split())[:200]
        raise DataError(f"not a valid tokenizer.json: {path} ({reason})") from None


SHIPPED_TOKENIZER = "tokenizer.json"
"""The shipped tokenizer (a data asset): the demo's, and every run's without another."""

BASE_TOKENIZER = "tokenizer.json"
"""The tokenizer a base checkpoint was trained with, saved next to its weights (with its
``tokenizer_config.json`` when the base was imported from a Hugging Face checkpoint)."""


def recorded_tokenizer(base_checkpoint: Optional[str]) -> Optional[str]:
    """The tokenizer a local base checkpoint records, as ``--tokenizer`` takes it: the directory
    for an imported HF checkpoint (tokenizer.json with tokenizer_config.json: special tokens and
    chat template), else its tokenizer.json; None when it records none."""
    if not base_checkpoint or not os.path.isdir(base_checkpoint):
        return None
    path = os.path.join(base_checkpoint, BASE_TOKENIZER)
    if not os.path.isfile(path):
        return None
    if os.path.isfile(os.path.join(base_checkpoint, "tokenizer_config.json")):
        return base_checkpoint
    return path


def tokenizer_source(tokenizer: Optional[str], hf_checkpoint: Optional[str] = None,
                     base_checkpoint: Optional[str] = None) -> str:
    """The tokenizer a run or command uses: ``--tokenizer``, else the ``--hf-checkpoint``
    directory's, else the one the ``--base-checkpoint`` was trained with, else the shipped one.
    The one place this rule lives."""
    if tokenizer:
        return tokenizer
    if hf_checkpoint:
        return hf_checkpoint
    recorded = recorded_tokenizer(base_checkpoint)
    if recorded:
        return recorded
    return asset_path(SHIPPED_TOKENIZER)


def load_tokenizer(path: str) -> Tokenizer:
    """Load a ``tokenizer.json`` (Hugging Face ``tokenizers`` format) from a local path, or a
    Hugging Face checkpoint directory (see :func:`load_hf_tokenizer`).

    A missing file raises :class:`~megatron_slmoe.data.errors.DataFileNotFoundError`; a file that is
    not a valid tokenizer, or lacks ``<|pad|>``/``<|eos|>``, raises :class:`DataError`; each message
    is one line naming the file.
    """
    if os.path.isdir(path):
        return load_hf_tokenizer(path)
    path, backend = _backend(path)
    return Tokenizer(backend, path=path)


def _token_text(value, where: str, name: str) -> Optional[str]:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise DataError(f"{where}: {name} must be a string or {{'content': ...}}, got {value!r}")


def load_hf_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory: ``tokenizer.json``, with the
    ``eos_token`` / ``pad_token`` / ``bos_token`` and ``chat_template`` of
    ``tokenizer_config.json`` (a template in ``chat_template.jinja`` wins, as in transformers).
    Without a pad token, padding uses the eos token (padding is never a target)."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise DataFileNotFoundError(f"tokenizer directory has no tokenizer.json: {directory}")
    path, backend = _backend(os.path.join(directory, "tokenizer.json"))
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as err:
            raise DataError(f"{config_path}: not readable JSON ({err})") from None
        if not isinstance(config, dict):
            raise DataError(f"{config_path}: not a JSON object")
    where = config_path
    eos = _token_text(config.get("eos_token"), where, "eos_token")
    if eos is None:
        raise DataError(f"{where}: no eos_token (the end of a turn and of generation)")
    pad = _token_text(config.get("pad_token"), where, "pad_token") or eos
    bos = _token_text(config.get("bos_token"), where, "bos_token")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    if template is not None and not isinstance(template, str):
        raise DataError(f"{where}: chat_template must be a string, got {type(template).__name__}")
    # Tokens the config names are special whatever tokenizer.json says (as transformers treats them).
    backend.add_special_tokens([t for t in (eos, pad, bos) if t and backend.token_to_id(t) is not None])
    for role, token in (("eos_token", eos), ("pad_token", pad), ("bos_token", bos)):
        if token is not None and backend.token_to_id(token) is None:
            raise DataError(f"{where}: {role} {token!r} is not in {path}")
    return Tokenizer(backend, path=path, pad=pad, eos=eos, bos=bos, chat_template=template)


def iter_training_texts(path: str) -> Iterator[str]:
    """Texts to train a tokenizer on: the lines of a text file, or for ``.jsonl`` the string fields
    ``text``, ``prompt``, ``response`` and ``messages[].content`` of each record (bad lines are
    ignored here; the dataset readers report them)."""
    path = require_file(path, "tokenizer training file")
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
            yield from f
            return
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            for key in ("text", "prompt", "response"):
                if isinstance(record.get(key), str):
                    yield record[key]
            messages = record.get("messages")
            if isinstance(messages, list):
                for m in messages:
                    if isinstance(m, dict) and isinstance(m.get("content"), str):
                        yield m["content"]


def train_tokenizer(text_files: Sequence[str], vocab_size: int, output_path: str,
                    special_tokens: Sequence[str] = SPECIAL_TOKENS,
                    min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``text_files`` (``.txt`` or ``.jsonl``, see
    :func:`iter_training_texts`) and write it to ``output_path`` (a ``tokenizer.json``).

    The vocabulary is the special tokens (ids 0..len-1, in order), the 256 byte symbols, then
    merges up to ``vocab_size`` in all. The result is deterministic for the same inputs.
    """
    special_tokens = list(special_tokens)
    for required in (PAD, EOS):
        if required not in special_tokens:
            raise DataError(f"special_tokens must include {required}")
    minimum = len(special_tokens) + 256
    if vocab_size < minimum:
        raise DataError(f"vocab_size {vocab_size} is below {minimum} "
                        f"({len(special_tokens)} special tokens + 256 byte symbols)")
    if not text_files:
        raise DataError("no training text files given")
    files = [require_file(p, "tokenizer training file") for p in text_files]

    tk = _tokenizers()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for p in files:
            yield from iter_training_texts(p)

    backend.train_from_iterator(texts(), trainer=trainer)
    tokenizer = Tokenizer(backend, path=os.fspath(output_path))
    tokenizer.save(os.fspath(output_path))
    return tokenizer


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_chatml_tokenizer(directory: str, texts: Optional[list[str]] = None,
                           vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer with ChatML's special tokens and template, trained on
    ``texts`` (default: the shipped demo corpus), as a checkpoint directory holds it."""
    import tokenizers

    if texts is None:
        texts = list(iter_training_texts(asset_path("corpus.txt")))
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "chat_template": CHATML_TEMPLATE}, f, indent=2)
