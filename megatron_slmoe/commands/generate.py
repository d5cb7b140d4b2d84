"""Generate answers with a base model and an optional LoRA adapter, in any parallel layout.

    python -m megatron_slmoe.generate --base-checkpoint runs/demo/base \\
        --adapter runs/demo/lora-X/adapter --prompts prompts.jsonl --output answers.jsonl
    torchrun --nproc-per-node 2 -m megatron_slmoe.generate --expert-model-parallel-size 2 ...

The base is a Megatron dist checkpoint (loaded into whatever layout the run has); the adapter is
an adapter directory as fine-tuning writes it. Prompts: JSON lines, each ``{"prompt": "..."}``
or ``{"messages": [...]}`` in the chat template of fine-tuning; a record that ends with the
assistant's answer (``{"prompt", "response"}``, or messages ending with an assistant message) is
answered without it and scored against it (exact match). Output: one JSON line per prompt, in
input order, ``{"index", "prompt", "answer", "tokens", "reference", "exact_match"}``, written
atomically by rank 0.

Decoding: greedy by default; ``--temperature T`` samples from softmax(logits / T), ``--top-p P``
keeps the smallest set of likely tokens with mass P; each prompt draws from its own generator
(``--seed`` and its index), so answers do not depend on the layout or the batch. The KV cache is
Megatron-Core's; ``--no-kv-cache`` recomputes the whole sequence at every step.

Bad input (missing files, a malformed prompt record, an adapter for another model, a layout that
does not divide the world) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from typing import Optional

from megatron_slmoe.commands.cli import BadInput, user_errors
from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.scoring import exact_match
from megatron_slmoe.data.tokenizer import load_tokenizer
from megatron_slmoe.parallel.layout import layout_problem
from megatron_slmoe.training.cli import LAYOUT_FLAGS, OneLineParser, add_run_flags, run_section
from megatron_slmoe.utils.atomic import write_text_atomic
from megatron_slmoe.utils.jsonl import numbered_records


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = OneLineParser(prog="slmoe-generate", description=__doc__.splitlines()[0])
    model = parser.add_argument_group("model (one of --base-checkpoint and --hf-checkpoint)")
    add_run_flags(model, "model.base_checkpoint", "model.hf_checkpoint", "model.config",
                  defaults={"model.config": None},
                  helps={"model.base_checkpoint": "Megatron dist checkpoint directory of the base "
                                                  "model (a --save-base or slmoe-convert-hf "
                                                  "import output)",
                         "model.hf_checkpoint": "Hugging Face checkpoint directory of the base "
                                                "model (config.json, safetensors, tokenizer)",
                         "model.config": "model config name or YAML file (default: the one the "
                                         "base checkpoint records)"})
    model.add_argument("--adapter", help="LoRA adapter directory (default: the base alone)")
    add_run_flags(model, "data.tokenizer", "model.precision",
                  helps={"data.tokenizer": "tokenizer.json or a checkpoint directory (default: "
                                           "the base's)"})
    io = parser.add_argument_group("prompts and answers")
    io.add_argument("--prompts", required=True, help="JSON lines of prompts (see above)")
    io.add_argument("--output", required=True, help="JSON lines of answers, in prompt order")
    decoding = parser.add_argument_group("decoding")
    decoding.add_argument("--max-new-tokens", type=int, default=64,
                          help="tokens generated per prompt at most [default: 64]")
    decoding.add_argument("--temperature", type=float, default=0.0,
                          help="0: greedy; > 0: sample [default: 0]")
    decoding.add_argument("--top-p", type=float, default=1.0,
                          help="nucleus sampling mass, with --temperature > 0 [default: 1.0]")
    decoding.add_argument("--seed", type=int, default=0, help="sampling seed [default: 0]")
    decoding.add_argument("--batch-size", type=int, default=32,
                          help="prompts per forward pass on each model replica [default: 32]")
    decoding.add_argument("--no-kv-cache", action="store_true",
                          help="recompute the whole sequence at every step (a reference)")
    layout = parser.add_argument_group("parallel layout (under torchrun)")
    add_run_flags(layout, *LAYOUT_FLAGS)
    return parser.parse_args(argv)


# --- inputs --------------------------------------------------------------------------------------


def read_prompts(path: str) -> list[list[dict]]:
    """The conversations of a prompt file; a malformed record is a BadInput naming its line."""
    from megatron_slmoe.data.instruction import ROLES, parse_record

    if not os.path.isfile(path):
        raise BadInput(f"--prompts {path}: no such file")
    conversations = []
    for number, record in numbered_records(path):
        try:
            if isinstance(record, ValueError):
                raise record
            if isinstance(record, dict) and "prompt" in record and "response" not in record:
                if not isinstance(record["prompt"], str):
                    raise ValueError("prompt must be a string")
                messages = [{"role": "user", "content": record["prompt"]}]
            elif (isinstance(record, dict) and isinstance(record.get("messages"), list)
                  and record["messages"] and isinstance(record["messages"][-1], dict)
                  and record["messages"][-1].get("role") == "user"):
                # A conversation waiting for the assistant: check it as a complete one would be.
                messages = parse_record({"messages": record["messages"]
                                         + [{"role": "assistant", "content": "-"}]})[:-1]
            else:
                messages = parse_record(record)
        except ValueError as err:
            raise BadInput(f"{path}:{number}: {err} (expected {{\"prompt\": ...}} or "
                           f"{{\"messages\": [...]}} with roles {', '.join(ROLES)})") from None
        conversations.append(messages)
    if not conversations:
        raise BadInput(f"--prompts {path}: no prompts")
    return conversations


def _check_args(args: argparse.Namespace, world_size: int):
    """(model section, parallel section) of the command line, checked by the run
    configuration's own rules, and the files and the layout; nothing is read yet."""
    for flag, path in (("--base-checkpoint", args.base_checkpoint),
                       ("--hf-checkpoint", args.hf_checkpoint), ("--adapter", args.adapter)):
        if path is not None and not os.path.isdir(path):
            raise BadInput(f"{flag} {path}: no such directory")
    if args.tokenizer is not None and not os.path.exists(args.tokenizer):
        raise BadInput(f"--tokenizer {args.tokenizer}: no such file or directory")
    _check_output(args.output, args.prompts)
    for flag, value in (("--max-new-tokens", args.max_new_tokens),
                        ("--batch-size", args.batch_size)):
        if value < 1:
            raise BadInput(f"{flag} must be >= 1, got {value}")
    model, parallel = run_section(args, "model"), run_section(args, "parallel")
    problem = layout_problem(world_size, parallel.tensor_model_parallel_size,
                             parallel.pipeline_model_parallel_size,
                             parallel.expert_model_parallel_size)
    if problem:
        raise BadInput(problem)
    return model, parallel


def _check_output(output: str, prompts: str) -> None:
    """The answers go to a new or existing file that is not the prompts, in a folder that is."""
    if os.path.exists(prompts) and os.path.exists(output) and os.path.samefile(output, prompts):
        raise BadInput(f"--output {output} is the --prompts file: the answers would replace "
                       f"the prompts (name another file)")
    if os.path.isdir(output):
        raise BadInput(f"--output {output} is a directory (name a file to write the answers to)")
    folder = os.path.dirname(os.path.abspath(output))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise BadInput(f"--output {output}: {folder} is not a directory")


# --- the run -------------------------------------------------------------------------------------


def _build(args: argparse.Namespace, base, parallel, platform):
    """This rank's stage of the base model (+ adapter), ready to generate."""
    from megatron_slmoe.lora.adapter import AdapterError, load_adapter, read_adapter_config
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.runtime import model as runtime

    precision = runtime.resolve_precision(base.section, platform)
    if "WORLD_SIZE" not in os.environ:  # a plain process, not under torchrun
        from megatron_slmoe.platform.single_rank import init_single_rank

        init_single_rank(args.seed)
    runtime.init_distributed(parallel, args.seed, platform)
    model, _ = runtime.build_model(base.model_config, parallel, precision == "bf16", platform,
                                   initialize=False,
                                   build=runtime.model_builder(build_gpt_model, base.hf))
    try:
        runtime.load_base_weights(model, base.section, base.hf)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001  (torch's CheckpointException is a BaseException)
        where = args.base_checkpoint or args.hf_checkpoint
        raise BadInput(f"cannot load the base model {where} as model config "
                       f"{base.model_config.name}: {type(err).__name__}: "
                       f"{' '.join(str(err).split())[:300]}") from None
    if args.adapter:
        try:
            lora_config, _ = read_adapter_config(args.adapter)
            inject_lora([model], lora_config)
            load_adapter([model], args.adapter)  # its base was checked before
        except AdapterError as err:
            raise BadInput(" ".join(str(err).split())) from None
    return model


def generate(args: argparse.Namespace) -> dict:
    """Run the generation; returns the summary (rank 0 also writes the output file)."""
    import torch
    from megatron.core import parallel_state

    from megatron_slmoe.platform import apply_adaptor
    from megatron_slmoe.runtime.bases import check_adapter, open_base
    from megatron_slmoe.inference import SamplingConfig, TextGenerator
    from megatron_slmoe.inference.answers import answer_all, request_for

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model_section, parallel = _check_args(args, world_size)
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        base = open_base(base_checkpoint=model_section.base_checkpoint,
                         hf_checkpoint=model_section.hf_checkpoint,
                         model_config=model_section.config if args.model_config else None,
                         tokenizer=args.tokenizer, adapter=args.adapter)
        tokenizer = load_tokenizer(base.tokenizer)
        if args.adapter:
            check_adapter(args.adapter, base.model_config, tokenizer)
    except (ValueError, DataError) as err:  # ConfigError is a ValueError
        raise BadInput(str(err)) from None
    conversations = read_prompts(args.prompts)
    requests = [request_for(tokenizer, m, args.max_new_tokens) for m in conversations]
    model_config = base.model_config
    placeholder = _image_placeholder(base.hf)
    for number, request in enumerate(requests):
        if placeholder and placeholder[1] in request.prompt_ids:  # as training refuses it
            raise BadInput(f"prompt {number} holds the model's image placeholder "
                           f"{placeholder[0]} (token id {placeholder[1]}) and no image goes with "
                           f"it (slmoe-generate answers text prompts): remove it from the prompt")
        length = len(request.prompt_ids) + request.max_new_tokens
        if length > model_config.max_sequence_length:
            raise BadInput(f"prompt {number} has {len(request.prompt_ids)} tokens; with "
                           f"--max-new-tokens {request.max_new_tokens} that exceeds the model's "
                           f"max_sequence_length {model_config.max_sequence_length}")
    model = _build(args, base, parallel, apply_adaptor())

    generator = TextGenerator(model, tokenizer.eos_id, tokenizer.vocab_size,
                              max_batch_size=args.batch_size, use_kv_cache=not args.no_kv_cache)
    answers = answer_all(generator, tokenizer, requests, parallel_state.get_data_parallel_rank(),
                         parallel_state.get_data_parallel_world_size(), sampling)
    summary = {"prompts": len(requests), "output": args.output, "scored": 0, "exact_match": 0}
    if torch.distributed.get_rank() == 0:
        lines = []
        for index, (messages, request, text) in enumerate(zip(conversations, requests, answers)):
            record = {"index": index, "prompt": _last_user(messages), "answer": text,
                      "tokens": len(tokenizer.encode(text)),
                      "reference": request.reference, "exact_match": None}
            if request.reference is not None:
                record["exact_match"] = exact_match(text, request.reference)
                summary["scored"] += 1
                summary["exact_match"] += int(record["exact_match"])
            lines.append(json.dumps(record, ensure_ascii=False))
        write_text_atomic(args.output, "\n".join(lines) + "\n")
    return summary


def _image_placeholder(hf) -> Optional[tuple[str, int]]:
    """(token, id) of an opened multimodal checkpoint's image placeholder, else None."""
    if hf is None or not hf.multimodal:
        return None
    return hf.family.image_token, hf.family.hf_config(hf.checkpoint.config_path).image_token_id


def _last_user(messages: list[dict]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


@user_errors(ConfigError)
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.ERROR)  # construction chatter
    warnings.simplefilter("ignore", FutureWarning)  # torch deprecations inside Megatron's loader
    summary = generate(args)
    if int(os.environ.get("RANK", "0")) == 0:
        line = f"wrote {summary['prompts']} answers to {summary['output']}"
        if summary["scored"]:
            line += (f"; exact match {summary['exact_match']}/{summary['scored']} "
                     f"({summary['exact_match'] / summary['scored']:.1%})")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
