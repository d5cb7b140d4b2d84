"""The bad-input inventory: every user-facing input, broken the ways users break it, is refused
before anything starts, with exit code 2, one line naming the offending input, and nothing
written to the output directory.

Inputs: flags and ``--config`` YAML, model configs, tokenizers, data files and their records, base
checkpoints (missing, empty, truncated, of another model or tokenizer), starting adapters (of
another rank, alpha, targets, model or tokenizer; unreadable), the output directory of an earlier
run (changed settings, fewer steps), launcher environment variables and network profiles. The
entry point's cases run in this process (``finetune.main(argv)`` with ``--validate-only``, what
the launcher runs before torchrun); the launcher's go through ``scripts/pretrain_lora.sh``, whose
own checks come before any Python starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.sysfs import ROCE_GIDS, fake_sysfs

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "megatron_slmoe" / "assets"
SHIPPED_TOKENIZER = ASSETS / "tokenizer.json"
GOOD_RECORD = '{"prompt": "Write in digits: one two", "response": "1 2"}\n'


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _other_tokenizer(path: Path) -> Path:
    """The shipped tokenizer with two ordinary tokens swapped: same size, another tokenizer."""
    data = json.loads(SHIPPED_TOKENIZER.read_text())
    vocab = data["model"]["vocab"]
    a, b = [token for token, index in vocab.items() if index in (100, 101)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return _write(path, json.dumps(data))


def _large_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(SHIPPED_TOKENIZER))
    backend.add_tokens([f"<extra_{i}>" for i in range(600)])
    return _write(path, backend.to_str())


def _fake_base(path: Path, *, model: str = "tiny", tokenizer: Path = SHIPPED_TOKENIZER,
               manifest: bool = True) -> Path:
    """A directory shaped like a base checkpoint (the checks before a run read no weights)."""
    from megatron_slmoe.utils.manifest import inventory as _inventory

    path.mkdir(parents=True)
    _write(path / "metadata.json", '{"sharded_backend": "torch_dist"}')
    _write(path / ".metadata", "x" * 64)
    (path / "__0_0.distcp").write_bytes(b"\0" * 4096)
    _write(path / "model_config.txt", model)
    shutil.copyfile(tokenizer, path / "tokenizer.json")
    if manifest:
        _write(path / "MANIFEST.json", json.dumps({"files": _inventory(str(path))}))
    return path


def _fake_adapter(path: Path, rank: int = 8, alpha: float = 16.0, targets=None, **base) -> Path:
    import torch
    from safetensors.torch import save_file

    from megatron_slmoe.lora.config import DEFAULT_LORA_TARGETS, LoRAConfig
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.lora.adapter import adapter_config_json

    lora = LoRAConfig(rank=rank, alpha=alpha, targets=list(targets or DEFAULT_LORA_TARGETS))
    from megatron_slmoe.lora.adapter import base_identity
    from megatron_slmoe.model.model_file import load_model_config

    info = {**base_identity(load_model_config("tiny"), load_tokenizer(str(SHIPPED_TOKENIZER))),
            **base}
    _write(path / "adapter_config.json", adapter_config_json(lora, info))
    save_file({"x": torch.zeros(2)}, str(path / "adapter_model.safetensors"))
    return path


def _earlier_run(path: Path, steps: int, lora_rank: int = 8, lr: float = 2e-3) -> Path:
    """An output directory an earlier run left: its config.yaml and a complete checkpoint."""
    from megatron_slmoe.training.cli import parse_command_line, to_yaml

    run = parse_command_line(["--lora-rank", str(lora_rank), "--lr", str(lr), "--output-dir",
                              str(path), "--precision", "fp32"], prog="t", description="",
                             world_size=0).run
    _write(path / "config.yaml", to_yaml(run))
    _write(path / "checkpoints" / f"iter_{steps:07d}" / "MANIFEST.json", '{"files": {}}')
    return path


def _real_base(path: Path) -> Path:
    """The tiny model saved as a base, as a full fine-tune's --save-base writes it."""
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.training.checkpointing import save_base_checkpoint

    mc = load_model_config("tiny")
    model = build_gpt_model(mc, mc.transformer_config(use_cpu_initialization=True))
    save_base_checkpoint(model, str(path), "tiny", load_tokenizer(str(SHIPPED_TOKENIZER)))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, megatron_single_rank):
    root = tmp_path_factory.mktemp("bad-inputs")
    files = {"root": root}
    files["real_base"] = _real_base(root / "bases" / "real")
    files["real_cut"] = root / "bases" / "real-cut"
    shutil.copytree(files["real_base"], files["real_cut"])
    shard = sorted(files["real_cut"].glob("*.distcp"))[-1]
    files["real_shard"] = shard.name
    files["real_size"] = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    files["other_tok"] = _other_tokenizer(root / "tok" / "other.json")
    files["large_tok"] = _large_tokenizer(root / "tok" / "large.json")
    files["not_tok"] = _write(root / "tok" / "broken.json", '{"model": ')
    files["good_data"] = _write(root / "data" / "good.jsonl", GOOD_RECORD * 10)
    files["empty_data"] = _write(root / "data" / "empty.jsonl", "")
    files["bad_data"] = _write(root / "data" / "bad.jsonl",
                               GOOD_RECORD * 3 + '{"prompt": "x"\n' * 4 + '"just a string"\n' * 3)
    files["all_bad"] = _write(root / "data" / "all_bad.jsonl", '{"response": ""}\n' * 5)
    files["idx"] = _write(root / "data" / "garbage.idx", "not an index")
    _write(root / "data" / "garbage.bin", "")
    tiny = (REPO / "megatron_slmoe" / "model" / "configs" / "tiny.yaml").read_text()
    files["cfg_unknown"] = _write(root / "models" / "unknown_key.yaml", tiny + "extra: 1\n")
    files["cfg_type"] = _write(root / "models" / "bad_type.yaml",
                               tiny.replace("num_layers: 4", "num_layers: four"))
    files["cfg_yaml"] = _write(root / "models" / "not_yaml.yaml", "model: [\n")
    files["cfg_no_latent"] = _write(root / "models" / "no_latent.yaml",
                                    tiny.replace("  moe_latent_size: 32", ""))
    files["base"] = _fake_base(root / "bases" / "good")
    files["base_empty"] = root / "bases" / "empty"
    files["base_empty"].mkdir(parents=True)
    files["base_truncated"] = _fake_base(root / "bases" / "truncated")
    (files["base_truncated"] / "__0_0.distcp").write_bytes(b"\0" * 1000)
    files["base_missing"] = _fake_base(root / "bases" / "missing")
    (files["base_missing"] / "__0_0.distcp").unlink()
    files["base_small"] = _fake_base(root / "bases" / "small", model="small")
    files["base_tok"] = _fake_base(root / "bases" / "other-tok", tokenizer=files["other_tok"])
    files["base_nometa"] = _fake_base(root / "bases" / "no-metadata", manifest=False)
    (files["base_nometa"] / ".metadata").unlink()
    files["base_zero"] = _fake_base(root / "bases" / "zero", manifest=False)
    (files["base_zero"] / "__0_0.distcp").write_bytes(b"")
    files["hf_empty"] = root / "hf" / "empty"
    files["hf_empty"].mkdir(parents=True)
    files["hf_no_shards"] = _write(root / "hf" / "no-shards" / "config.json",
                                   '{"architectures": ["Qwen3MoeForCausalLM"]}').parent
    files["adapter"] = _fake_adapter(root / "adapters" / "good")
    files["adapter_r16"] = _fake_adapter(root / "adapters" / "r16", rank=16)
    files["adapter_alpha"] = _fake_adapter(root / "adapters" / "alpha", alpha=4.0)
    files["adapter_targets"] = _fake_adapter(root / "adapters" / "targets", targets=["router"])
    from megatron_slmoe.lora.adapter import base_identity
    from megatron_slmoe.model.model_file import load_model_config

    files["adapter_small"] = _fake_adapter(
        root / "adapters" / "small", **base_identity(load_model_config("small")))
    files["adapter_tok"] = _fake_adapter(root / "adapters" / "tok", tokenizer_sha256="0" * 64)
    files["adapter_json"] = _fake_adapter(root / "adapters" / "json")
    _write(files["adapter_json"] / "adapter_config.json", "{not json")
    files["adapter_noconf"] = _fake_adapter(root / "adapters" / "noconf")
    (files["adapter_noconf"] / "adapter_config.json").unlink()
    files["adapter_cut"] = _fake_adapter(root / "adapters" / "cut")
    weights = files["adapter_cut"] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    files["run_r8"] = _earlier_run(root / "runs" / "r8", steps=50)
    files["run_r8b"] = _earlier_run(root / "runs" / "r8b", steps=50)
    files["run_bad_yaml"] = _earlier_run(root / "runs" / "bad-yaml", steps=50)
    _write(files["run_bad_yaml"] / "config.yaml", "lora: {rank: [\n")
    files["yaml_unknown"] = _write(root / "yaml" / "unknown.yaml", "lora: {ranks: 8}\n")
    files["yaml_type"] = _write(root / "yaml" / "type.yaml", "lora: {rank: eight}\n")
    files["yaml_section"] = _write(root / "yaml" / "section.yaml", "loraa: {rank: 8}\n")
    files["yaml_broken"] = _write(root / "yaml" / "broken.yaml", "lora: {rank: [\n")
    files["yaml_twice"] = _write(root / "yaml" / "twice.yaml", "lora:\n  rank: 8\n  rank: 16\n")
    files["yaml_binary"] = root / "yaml" / "binary.yaml"
    files["yaml_binary"].write_bytes(bytes(range(256)) * 4)
    files["images_cut"], files["images_bad"] = _image_text_datasets(root / "images")
    files["a_file"] = _write(root / "files" / "a-file", "not a directory")
    return files


def _image_text_datasets(root: Path) -> tuple[Path, Path]:
    """(a dataset with a truncated shard, one whose every image is undecodable)."""
    import io

    from PIL import Image

    from megatron_slmoe.data.image_text_prepare import (
        ShardRecord,
        index_energon_dataset,
        write_shards,
    )

    png = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(png, format="PNG")
    chat = {"messages": [{"role": "user", "content": "<image>\nColour?"},
                         {"role": "assistant", "content": "red"}]}
    made = []
    for name, image in (("cut", png.getvalue()), ("bad", png.getvalue()[:30])):
        for split in ("train", "val"):
            write_shards([ShardRecord(chat, [("png", image)]) for _ in range(4)],
                         str(root / name), split, 2)
        index_energon_dataset(str(root / name), "chat")
        made.append(root / name)
    shard = made[0] / "train" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:600])
    return made[0], made[1]


# (input, argv with {placeholders}, needle in the one line); the output directory is added.
ENTRY_POINT_CASES = [
    # flags
    ("--lora-rank", ["--lora-rank", "100000"], "--lora-rank must be an integer in 1..256"),
    ("--lora-rank", ["--lora-rank", "eight"], "--lora-rank: invalid int value"),
    ("--lora-alpha", ["--lora-alpha", "0"], "--lora-alpha must be a positive finite number"),
    ("--lora-dropout", ["--lora-dropout", "1.0"], "--lora-dropout must be a number"),
    ("--lora-target-modules", ["--lora-target-modules", "qkv"], "unknown target 'qkv'"),
    # targets that name nothing in the model: found on the meta device before start-up
    ("--lora-target-modules", ["--base-checkpoint", "{base}", "--lora-target-modules",
                               "vision_attention", "projector"],
     "--lora-target-modules vision_attention projector: lora target 'vision_attention' matches "
     "nothing; targetable: linear_qkv, linear_proj, linear_fc1"),
    ("--lora-target-modules", ["--base-checkpoint", "{base}", "--model-config", "{cfg_no_latent}",
                               "--lora-target-modules", "linear_qkv", "latent"],
     "lora target 'latent' matches nothing; targetable: linear_qkv"),
    ("--model-config", ["--model-config", "nosuch"], "no model config named 'nosuch'"),
    ("--seq-length", ["--seq-length", "100000"], "--seq-length 100000 exceeds the model's"),
    ("--train-iters", ["--train-iters", "0"], "--train-iters must be positive"),
    ("--lr-warmup-iters", ["--lr-warmup-iters", "300"], "--lr-warmup-iters 300 must be below"),
    ("--tensor-model-parallel-size", ["--tensor-model-parallel-size", "3"],
     "world size 1 is not divisible by --tensor-model-parallel-size 3"),
    ("--global-batch-size", ["--global-batch-size", "6"],
     "--global-batch-size 6 is not divisible by --micro-batch-size"),
    ("--heartbeat-timeout", ["--heartbeat-timeout", "-1"], "--heartbeat-timeout must be >= 0"),
    ("--heartbeat-timeout", ["--heartbeat-timeout", "1800"],
     "--heartbeat-timeout 1800 s must be below"),
    ("--straggler-threshold", ["--straggler-threshold", "0.5"], "--straggler-threshold must be 0"),
    ("--max-malformed-fraction", ["--max-malformed-fraction", "1.5"],
     "--max-malformed-fraction must be in [0, 1)"),
    ("--use-persistent-ckpt-worker", ["--no-async-save", "--use-persistent-ckpt-worker"],
     "--use-persistent-ckpt-worker needs --async-save"),
    ("--no-such-flag", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("--lr", ["--lr", "inf"], "optimizer.lr: --lr must be a finite number, got inf"),
    ("--lr", ["--lr", "nan"], "--lr must be a finite number, got nan"),
    ("--seed", ["--seed", "-1"], "--seed must be in 0..2147483647, got -1"),
    ("--device-memory-gb", ["--device-memory-gb", "1e300"], "must be at most 1e+06 GiB"),
    ("--image-mean", ["--task", "image-text", "--image-mean", "0.5", "inf", "0.5"],
     "--image-mean must be list[finite float]"),
    # image-text data: checked before any process starts
    ("--train-data", ["--task", "image-text", "--base-checkpoint", "{base}", "--train-data",
                      "{images_cut}"], "shard train/shard-000001.tar is truncated"),
    ("--train-data", ["--task", "image-text", "--base-checkpoint", "{base}", "--train-data",
                      "{images_bad}"], "[train]: no usable sample: every one of its 4 records"),
    # the output directory
    ("--output-dir", ["--output-dir", "{a_file}"], "is a file, not a directory"),
    ("--output-dir", ["--output-dir", "{a_file}/run"], "is a file, not a directory"),
    # --config YAML
    ("--config", ["--config", "{root}/yaml/missing.yaml"], "--config {root}/yaml/missing.yaml"),
    ("--config", ["--config", "{yaml_unknown}"], "unknown key lora.ranks"),
    ("--config", ["--config", "{yaml_type}"], "lora.rank: --lora-rank must be int"),
    ("--config", ["--config", "{yaml_section}"], "unknown section 'loraa'"),
    ("--config", ["--config", "{yaml_broken}"], "not valid YAML"),
    ("--config", ["--config", "{yaml_twice}"],
     "--config {yaml_twice}: not valid YAML at line 3, column 3: key 'rank' given twice"),
    ("--config", ["--config", "{yaml_binary}"], "--config {yaml_binary}: not a text file"),
    # model configs
    ("model config", ["--model-config", "{cfg_unknown}"], "unknown key 'extra'"),
    ("model config", ["--model-config", "{cfg_type}"], "{cfg_type}"),
    ("model config", ["--model-config", "{cfg_yaml}"], "{cfg_yaml}"),
    # tokenizers
    ("--tokenizer", ["--tokenizer", "{root}/tok/none.json"], "--tokenizer {root}/tok/none.json"),
    ("--tokenizer", ["--tokenizer", "{not_tok}"], "not a valid tokenizer.json: {not_tok}"),
    ("--tokenizer", ["--tokenizer", "{large_tok}"], "has 1112 tokens, more than the model's"),
    ("--tokenizer", ["--tokenizer", "{other_tok}", "--base-checkpoint", "{base}"],
     "--tokenizer {other_tok} is not the tokenizer --base-checkpoint {base} was trained with"),
    # data files and records
    ("--train-data", ["--train-data", "{root}/data/none.jsonl", "--valid-data", "{good_data}"],
     "--train-data {root}/data/none.jsonl: no such file"),
    ("--train-data", ["--train-data", "{empty_data}", "--valid-data", "{good_data}"],
     "--train-data {empty_data} holds no records"),
    ("--train-data", ["--train-data", "{bad_data}", "--valid-data", "{good_data}"],
     "--train-data {bad_data}: 7 of 10 records are malformed, more than --max-malformed"),
    ("--valid-data", ["--train-data", "{good_data}", "--valid-data", "{all_bad}"],
     "--valid-data {all_bad}: 5 of 5 records are malformed"),
    ("--valid-data", ["--train-data", "{good_data}"],
     "--train-data {good_data} needs --valid-data"),
    ("--train-data (pretrain)", ["--data-format", "pretrain", "--train-data", "{root}/data/nope"],
     "--train-data {root}/data/nope: indexed dataset file not found"),
    ("--train-data (pretrain)",
     ["--data-format", "pretrain", "--train-data", "{root}/data/garbage"],
     "--train-data {root}/data/garbage: not a valid indexed dataset"),
    # base checkpoints
    ("--base-checkpoint", ["--base-checkpoint", "{root}/bases/none"],
     "--base-checkpoint {root}/bases/none: no such file"),
    ("--base-checkpoint", ["--base-checkpoint", "{good_data}"], "is not a directory"),
    ("--base-checkpoint", ["--base-checkpoint", "{base_empty}"], "is an empty directory"),
    ("--base-checkpoint", ["--base-checkpoint", "{base_truncated}"],
     "is damaged: __0_0.distcp has 1000 bytes, the manifest says 4096"),
    ("--base-checkpoint", ["--base-checkpoint", "{base_missing}"],
     "is damaged: __0_0.distcp is missing"),
    ("--base-checkpoint", ["--base-checkpoint", "{base_small}"], "holds model 'small'"),
    # Without --tokenizer a base's own is used; a --tokenizer that is not it is refused.
    ("--base-checkpoint", ["--base-checkpoint", "{base_tok}", "--tokenizer", str(SHIPPED_TOKENIZER)],
     "is not the tokenizer --base-checkpoint {base_tok} was trained with"),
    ("--base-checkpoint", ["--base-checkpoint", "{real_cut}"],
     "--base-checkpoint {real_cut} is damaged: {real_shard} has 100 bytes, the manifest says "
     "{real_size}"),
    ("--base-checkpoint", ["--base-checkpoint", "{real_base}", "--tokenizer", "{other_tok}"],
     "--tokenizer {other_tok} is not the tokenizer --base-checkpoint {real_base} was trained with "
     "({real_base}/tokenizer.json): pass --tokenizer {real_base}/tokenizer.json"),
    ("--base-checkpoint", ["--base-checkpoint", "{real_base}", "--model-config", "small"],
     "--base-checkpoint {real_base} holds model 'tiny' (recorded in the checkpoint), not 'small'"),
    ("--base-checkpoint", ["--base-checkpoint", "{base_nometa}"], "has no .metadata"),
    ("--base-checkpoint", ["--base-checkpoint", "{base_zero}"], "__0_0.distcp is empty"),
    # starting adapters
    ("--adapter-init", ["--adapter-init", "{adapter_r16}"],
     "--adapter-init {adapter_r16} has lora.rank 16, but --lora-rank is 8"),
    ("--adapter-init", ["--adapter-init", "{adapter_alpha}"],
     "has lora.alpha 4.0, but --lora-alpha"),
    ("--adapter-init", ["--adapter-init", "{adapter_targets}"], "has lora.targets ['router']"),
    ("--adapter-init", ["--adapter-init", "{adapter_small}"],
     "was trained on another model ('small') than 'tiny'"),
    ("--adapter-init", ["--adapter-init", "{adapter_tok}"], "was trained with another tokenizer"),
    ("--adapter-init", ["--adapter-init", "{adapter_json}"],
     "adapter_config.json is not valid JSON"),
    ("--adapter-init", ["--adapter-init", "{adapter_noconf}"], "cannot read"),
    ("--adapter-init", ["--adapter-init", "{adapter_cut}"], "is not a readable safetensors file"),
    # Hugging Face checkpoints, exports, object storage
    ("--hf-checkpoint", ["--hf-checkpoint", "{root}/nowhere"], "no such directory"),
    ("--hf-checkpoint", ["--hf-checkpoint", "{hf_empty}"], "no config.json in the checkpoint"),
    ("--hf-checkpoint", ["--hf-checkpoint", "{hf_no_shards}"], "no *.safetensors shards"),
    ("--export-hf", ["--export-hf", "{root}/peft-out"],
     "--export-hf needs --hf-checkpoint and --finetune-mode lora"),
    ("--export-hf-layout", ["--export-hf-layout", "diagonal"], "invalid choice: 'diagonal'"),
    ("--output-url", ["--output-url", "ftp://bucket/run"], "expected an s3:// or msc:// URL"),
    ("--train-data", ["--train-data", "s3://"], "'' is not a valid bucket name"),
    # the output directory of an earlier run
    ("--output-dir", ["--lora-rank", "16", "--output-dir", "{run_r8}"],
     "--lora-rank 16 differs from 8 in {run_r8}/config.yaml, the run this would resume"),
    ("--output-dir", ["--lr", "1e-3", "--output-dir", "{run_r8}"], "--lr 0.001 differs from 0.002"),
    ("--output-dir", ["--train-iters", "20", "--output-dir", "{run_r8b}"],
     "--train-iters 20 is below the 50 steps the run in {run_r8b} has trained"),
    ("--output-dir", ["--output-dir", "{run_bad_yaml}"],
     "{run_bad_yaml}/config.yaml, the configuration of the run this would resume, is unreadable"),
]


def _expand(items, files):
    names = {k: str(v) for k, v in files.items()}
    return [item.format(**names) for item in items]


def _tree(path: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in path.rglob("*")} if path.exists() else {}


@pytest.mark.parametrize("what, argv, needle", ENTRY_POINT_CASES,
                         ids=[f"{i:02d}-{c[0]}" for i, c in enumerate(ENTRY_POINT_CASES)])
def test_entry_point_refuses_in_one_line(inputs, what, argv, needle, tmp_path, capsys,
                                         monkeypatch):
    from megatron_slmoe.training.finetune import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = _expand(argv, inputs)
    if "--output-dir" not in argv:
        argv += ["--output-dir", str(tmp_path / "out")]
    out_dir = Path(argv[argv.index("--output-dir") + 1])
    before = _tree(out_dir)
    try:
        code = main([*argv, "--validate-only"])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert _expand([needle], inputs)[0] in err
    assert _tree(out_dir) == before  # nothing written


LAUNCHER_CASES = [
    ("NNODES", {"NNODES": "0"}, "error: NNODES=0 must be an integer >= 1"),
    ("NPROC_PER_NODE", {"NPROC_PER_NODE": "two"},
     "error: NPROC_PER_NODE=two must be an integer >= 1"),
    ("NODE_RANK", {"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, "error: NODE_RANK is not set"),
    ("NODE_RANK", {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"},
     "error: NODE_RANK=2 must be below NNODES=2"),
    ("MASTER_ADDR", {"NNODES": "2", "NODE_RANK": "0"}, "error: MASTER_ADDR is not set"),
    ("MASTER_PORT", {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1",
                     "MASTER_PORT": "70000"}, "error: MASTER_PORT=70000 must be at most 65535"),
    ("MAX_RESTARTS", {"MAX_RESTARTS": "-1"}, "error: MAX_RESTARTS=-1 must be an integer >= 0"),
    ("NETWORK_PROFILE", {"NETWORK_PROFILE": "opa"}, "error: NETWORK_PROFILE=opa is not one of"),
    ("NCCL_IB_GID_INDEX", {"NETWORK_PROFILE": "roce", "NCCL_IB_GID_INDEX": "2"},
     "netcheck: NCCL_IB_GID_INDEX=2: GID 2 of mlx5_0 port 1 is 'IB/RoCE v1', not 'RoCE v2'"),
]


@pytest.mark.parametrize("what, env, line", LAUNCHER_CASES, ids=[c[0] for c in LAUNCHER_CASES])
def test_launcher_refuses_in_one_line(what, env, line, tmp_path):
    sysfs = fake_sysfs(tmp_path / "sys", hcas={"mlx5_0": {1: ("4: ACTIVE", "Ethernet", ROCE_GIDS)}})
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("NCCL_", "HCCL_", "RDZV_", "MASTER_", "NODE_RANK", "NNODES",
                                  "NPROC_PER_NODE", "NETWORK_PROFILE", "MAX_RESTARTS"))}
    out_dir = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/pretrain_lora.sh", "--train-iters", "5",
                           "--output-dir", str(out_dir)], cwd=REPO,
                          env={**clean, "SLMOE_SYSFS_ROOT": str(sysfs), "TORCHRUN": "false", **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(line), proc.stderr
    assert not out_dir.exists()


def test_inventory_size():
    """At least 40 cases over at least 30 distinct inputs (the counts go in the notes)."""
    cases = ENTRY_POINT_CASES + LAUNCHER_CASES
    inputs = {c[0] for c in cases}
    print(f"\nbad-input inventory: {len(cases)} cases over {len(inputs)} distinct inputs")
    assert len(cases) >= 40 and len(inputs) >= 30


def test_a_disk_too_full_for_the_checkpoints_is_refused_before_start(inputs, tmp_path, capsys,
                                                                     monkeypatch):
    """The output file system's free space against the checkpoints the run keeps: one line
    before start-up (a full disk mid-save ended in a traceback)."""
    import shutil
    from collections import namedtuple

    from megatron_slmoe.training.finetune import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 4096, 4096))
    code = main(["--base-checkpoint", str(inputs["base"]), "--output-dir", str(tmp_path / "out"),
                 "--validate-only"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "its file system has 4.00 KiB free; the run's checkpoints need about" in err, err
    assert "need about 0.00 GiB" not in err  # a figure with enough digits (it read 0.00 GiB)
    assert "--keep-last 2" in err and not (tmp_path / "out").exists()


def _os_error(code: int, path: str) -> OSError:
    """The error Python raises for a failed open() or write() of ``path``."""
    return OSError(code, os.strerror(code), path)


@pytest.mark.parametrize("err, needle", [
    ("config", "--lora-rank must be"),
    ("erofs-out", "cannot write {out}/metrics.jsonl: Read-only file system (the output directory"),
    ("eacces-out", "cannot write {out}/checkpoints/iter_0000004.tmp: Permission denied"),
    ("enospc", "no space left on the device of {out}/metrics.jsonl (the newest complete"),
    ("wrapped", "no space left on the device of {out}/checkpoints"),
    ("object-gone", "s3://bucket/data/shard-000001.tar"),
    ("nan", "step 3: the training loss is nan"),
    ("gloo", None), ("oom", None), ("timeout", None),
])
def test_a_failure_that_repeats_is_told_from_one_a_restart_may_cure(err, needle, tmp_path):
    """One classification of every way a run ends: the user's mistakes (one base class), a loss
    gone NaN and an output that cannot be written end the job in one line; a lost peer, an
    out-of-memory error or a store that timed out keep the restart budget."""
    import errno

    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.storage.errors import ObjectNotFoundError, StorageTimeoutError
    from megatron_slmoe.training.engine import NonFiniteError
    from megatron_slmoe.training.reliability.failures import failure_that_repeats

    out = str(tmp_path / "run")

    def wrapped():
        try:
            raise _os_error(errno.ENOSPC, f"{out}/checkpoints/iter_0000002.tmp/__0_0.distcp")
        except OSError as cause:
            try:
                raise RuntimeError("CheckpointingException: save failed") from cause
            except RuntimeError as outer:
                return outer

    made = {"config": lambda: ConfigError("--lora-rank must be an integer in 1..256"),
            "erofs-out": lambda: _os_error(errno.EROFS, f"{out}/metrics.jsonl"),
            "eacces-out": lambda: _os_error(errno.EACCES, f"{out}/checkpoints/iter_0000004.tmp"),
            "enospc": lambda: _os_error(errno.ENOSPC, f"{out}/metrics.jsonl"),
            "wrapped": wrapped,
            "object-gone": lambda: ObjectNotFoundError(
                "no object s3://bucket/data/shard-000001.tar"),
            "nan": lambda: NonFiniteError("step 3: the training loss is nan; the run stops"),
            "gloo": lambda: RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"),
            "oom": lambda: RuntimeError("CUDA out of memory"),
            "timeout": lambda: StorageTimeoutError("s3://bucket/x: no answer in 300 s")}[err]()
    message = failure_that_repeats(made, out)
    if needle is None:
        assert message is None
    else:
        assert message is not None and needle.format(out=out) in message and "\n" not in message


def test_a_malformed_jsonl_on_object_storage_is_refused_before_start(inputs, tmp_path, capsys,
                                                                     monkeypatch):
    """A stored instruction file is checked as a local one is, before torchrun (through the node
    cache, where the run reads it), naming its URL (it was refused only after start-up, on every
    rank of every restart)."""
    from megatron_slmoe.training.finetune import main
    from tests.helpers.s3_server import S3TestServer

    monkeypatch.setenv("WORLD_SIZE", "1")
    with S3TestServer() as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        client = server.client()
        client.create_bucket(Bucket="data")
        client.put_object(Bucket="data", Key="bad.jsonl",
                          Body=inputs["bad_data"].read_bytes())
        client.put_object(Bucket="data", Key="good.jsonl",
                          Body=inputs["good_data"].read_bytes())
        code = main(["--base-checkpoint", str(inputs["base"]), "--train-data",
                     "s3://data/bad.jsonl", "--valid-data", "s3://data/good.jsonl",
                     "--cache-dir", str(tmp_path / "cache"), "--output-dir",
                     str(tmp_path / "out"), "--validate-only"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --train-data s3://data/bad.jsonl: 7 of 10 records are "
                          "malformed") and "the first: s3://data/bad.jsonl:4" in err, err
    assert str(tmp_path / "cache") not in err and not (tmp_path / "out").exists()
