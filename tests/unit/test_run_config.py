"""The run configuration tree: every field is reachable from the command line and from YAML, every
flag maps to a field that package code reads, --print-config fed back as --config gives the same
configuration, and bad input is one line naming the flag (or the file and key)."""

import re
from pathlib import Path

import pytest
import yaml

from megatron_slmoe.training.cli import build_parser, build_run_config, parse_command_line, to_yaml
from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.training.config import RunConfig, validate_run
from megatron_slmoe.config.schema import settings

ROOT = Path(__file__).resolve().parents[2]

# A value for every field of the tree, each different from its default, valid together.
NON_DEFAULT = {
    "model": {"config": "small", "base_checkpoint": "base/", "hf_checkpoint": None,
              "hf_shape_check": False, "hf_unmap_mib": 16, "adapter_init": "adapter/",
              "finetune_mode": "lora", "precision": "bf16",
              "expert_weights": "dequantize"},
    "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                 "expert_model_parallel_size": 4, "use_distributed_optimizer": True,
                 "distributed_timeout_minutes": 7, "recompute_granularity": "selective",
                 "recompute_modules": ["moe", "core_attn"], "memory_check": "warn",
                 "device_memory_gb": 80.0},
    "moe": {"token_dispatcher_type": "allgather", "hierarchical_alltoall": True, "node_size": 8,
            "overlap_chunks": 3, "routed_balance_coeff": 0.05, "routing_kl_coeff": 0.5},
    "lora": {"rank": 16, "alpha": 8.0, "dropout": 0.1, "targets": ["router", "latent"],
             "init_seed": 5, "expert_rank": 4, "moe_rank_scaling": False,
             "expert_layout": "shared-outer"},
    "data": {"task": "image-text", "format": "pretrain", "train_data": "train",
             "valid_data": "valid", "tokenizer": "tok.json", "seq_length": 256,
             "max_malformed_fraction": 0.25},
    "vision": {"model_type": "siglip", "img_h": 64, "img_w": 48, "patch_dim": 8,
               "num_layers": 3, "hidden_size": 96, "num_attention_heads": 6,
               "ffn_hidden_size": 192, "activation": "gelu_tanh", "layernorm_epsilon": 1e-6,
               "drop_class_token": False, "projector_type": "affine",
               "projector_ffn_hidden_size": 64, "image_token_index": -100,
               "checkpoint": "siglip/"},
    "image_text": {"max_tiles": 4, "thumbnail": True, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.25, 0.25, 0.25], "train_vision_tower": False,
                   "caption_prompt": "<image> Caption:", "eval_answers": 16,
                   "max_answer_tokens": 4},
    "optimizer": {"lr": 1e-3, "min_lr": 1e-5, "lr_warmup_iters": 3, "lr_decay_style": "linear",
                  "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.95, "clip_grad": 0.5},
    "schedule": {"micro_batch_size": 2, "global_batch_size": 32, "train_iters": 30,
                 "eval_interval": 5, "eval_iters": 2, "eval_accuracy_samples": 50,
                 "log_interval": 3, "save_interval": 6, "seed": 7},
    "monitor": {"window": 9, "starved_fraction": 0.2, "starved_patience": 4,
                "dominant_fraction": 0.6, "warmup_steps": 3, "min_routed_tokens": 64,
                "action": "stop", "jsonl_path": "routing.jsonl", "drift_interval": 4},
    "output": {"output_dir": "out", "output_url": "s3://bucket/runs/a", "tensorboard": False,
               "keep_last": 3, "resume": False, "save_base": None, "plots": False,
               "export_hf": None, "export_hf_layout": "fused", "async_save": False,
               "use_persistent_ckpt_worker": False},
    "storage": {"cache_dir": "nvme/cache", "cache_max_gb": 12.5, "cache_revalidate_seconds": 0.0,
                "prefetch_shards": 4, "retry_timeout_seconds": 120.0,
                "retry_backoff_seconds": 0.25, "preflight_timeout_seconds": 5.0},
    "health": {"heartbeat_timeout": 60.0, "straggler_threshold": 2.0},
}
# save_base and train_vision_tower need --finetune-mode full, which excludes --adapter-init;
# hf_checkpoint excludes --model-config and --base-checkpoint: each checked on its own below.


def _flags_for(values: dict) -> list[str]:
    argv = []
    for section, cls in RunConfig.sections().items():
        for f in settings(cls):
            if f.name not in values.get(section, {}):
                continue
            value, flag = values[section][f.name], f.metadata["flag"]
            if value is None:
                continue
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
    return argv


def test_the_table_covers_every_field_with_a_non_default_value():
    defaults = RunConfig().to_dict()
    for section, cls in RunConfig.sections().items():
        for f in settings(cls):
            assert f.name in NON_DEFAULT[section], f"add {section}.{f.name} to NON_DEFAULT"
            # save_base, finetune_mode, hf_checkpoint, train_vision_tower, export_hf: see the
            # *_is_reachable_too tests; the persistent writer needs --async-save (on by default),
            # which the table turns off; --moe-rank-scaling excludes the table's --expert-lora-rank
            if f.name not in ("save_base", "finetune_mode", "hf_checkpoint",
                              "train_vision_tower", "export_hf", "use_persistent_ckpt_worker",
                              "moe_rank_scaling"):
                assert NON_DEFAULT[section][f.name] != defaults[section][f.name], (section, f.name)


def test_every_field_is_reachable_from_flags_and_from_yaml(tmp_path):
    from_flags = parse_command_line(_flags_for(NON_DEFAULT), prog="t", description="",
                                    world_size=0).run
    assert from_flags.to_dict() == NON_DEFAULT
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(NON_DEFAULT))
    from_yaml = parse_command_line(["--config", str(path)], prog="t", description="",
                                   world_size=0).run
    assert from_yaml == from_flags
    validate_run(from_flags, world_size=2 * 2 * 4)


def test_save_base_is_reachable_too():
    run = parse_command_line(["--finetune-mode", "full", "--save-base", "b"], prog="t",
                             description="", world_size=1).run
    assert (run.output.save_base, run.model.finetune_mode) == ("b", "full")
    run = parse_command_line(["--finetune-mode", "full", "--train-vision-tower"], prog="t",
                             description="", world_size=1).run
    assert run.image_text.train_vision_tower
    with pytest.raises(ConfigError, match="--train-vision-tower needs --finetune-mode full"):
        parse_command_line(["--train-vision-tower"], prog="t", description="", world_size=1)

    run = parse_command_line(["--use-persistent-ckpt-worker"], prog="t", description="",
                             world_size=1).run
    assert run.output.use_persistent_ckpt_worker and run.output.async_save


def test_moe_rank_scaling_is_reachable_too():
    run = parse_command_line(["--moe-rank-scaling"], prog="t", description="", world_size=1).run
    assert run.lora.moe_rank_scaling and run.lora.expert_rank == 0
    with pytest.raises(ConfigError, match="--expert-lora-rank.*--moe-rank-scaling both"):
        parse_command_line(["--moe-rank-scaling", "--expert-lora-rank", "2"], prog="t",
                           description="", world_size=1)


def test_export_hf_is_reachable_too():
    run = parse_command_line(["--hf-checkpoint", "hf/", "--export-hf", "peft/"], prog="t",
                             description="", world_size=1).run
    assert run.output.export_hf == "peft/"
    with pytest.raises(ConfigError, match="--export-hf needs --hf-checkpoint"):
        parse_command_line(["--export-hf", "peft/"], prog="t", description="", world_size=1)


def test_hf_checkpoint_is_reachable_too():
    run = parse_command_line(["--hf-checkpoint", "hf/", "--no-hf-shape-check"], prog="t",
                             description="", world_size=1).run
    assert (run.model.hf_checkpoint, run.model.hf_shape_check) == ("hf/", False)


def test_flags_win_over_yaml_and_yaml_over_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lora:\n  rank: 32\n  alpha: 4\nschedule:\n  train_iters: 9\n")
    run = parse_command_line(["--config", str(path), "--lora-rank", "4"], prog="t",
                             description="", world_size=0).run
    assert (run.lora.rank, run.lora.alpha, run.schedule.train_iters) == (4, 4.0, 9)
    assert run.schedule.global_batch_size == RunConfig().schedule.global_batch_size


def test_print_config_fed_back_gives_the_same_configuration(tmp_path, capsys):
    from megatron_slmoe.training.finetune import main

    assert main([*_flags_for(NON_DEFAULT), "--print-config"]) == 0
    first = capsys.readouterr().out
    path = tmp_path / "config.yaml"
    path.write_text(first)
    assert main(["--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == first
    assert yaml.safe_load(first) == NON_DEFAULT
    assert to_yaml(build_run_config(yaml.safe_load(first))) == first


def test_every_flag_is_unique_and_every_field_is_read_by_package_code():
    """A flag nothing reads (like the old --exit-after-iters) fails here: each field must be read
    as an attribute of an object holding its section (tests/helpers/section_reads.py), outside
    the section's own checks."""
    from tests.helpers.section_reads import field_reads

    parser = build_parser("t", "")
    flags = [opt for action in parser._actions for opt in action.option_strings]
    assert len(flags) == len(set(flags))
    sections = {name: cls.__name__ for name, cls in RunConfig.sections().items()}
    reads = field_reads(ROOT / "megatron_slmoe", sections)
    # A setting that declares the model-file field it overrides is read where its section's
    # overrides are applied (``MoERunConfig.over``).
    unread = [f"{section}.{f.name}" for section, cls in RunConfig.sections().items()
              for f in settings(cls) if f.name not in reads[section]
              and not (f.metadata["overrides"] and "over" in reads[section])]
    assert unread == []


@pytest.mark.parametrize("source, read", [
    ("def f(run):\n    return run.lora.rank", True),
    ("def f(run):\n    lora = run.lora\n    return lora.rank", True),
    ("def f(lora: LoRAConfig):\n    return lora.rank", True),
    ("class T:\n    def __init__(self, run):\n        self.s = run.lora\n"
     "    def g(self):\n        return self.s.rank", True),
    ("def f(args):\n    return run_section(args, 'lora').rank", True),
    ("def f(other):\n    return other.rank", False),  # a rank of something else
    ("def f(model):\n    return model.lora.rank", False),  # not a run configuration
    ("class LoRAConfig:\n    def validate(self):\n        return self.rank", False),
])
def test_a_field_counts_as_read_only_on_its_sections_object(tmp_path, source, read):
    from tests.helpers.section_reads import field_reads

    (tmp_path / "m.py").write_text(source)
    reads = field_reads(tmp_path, {"lora": "LoRAConfig"})
    assert ("rank" in reads["lora"]) == read


@pytest.mark.parametrize("text, needle", [
    ("lora: {rank: 0}\n", "lora.rank: --lora-rank must be an integer in 1..256"),
    ("lora: {rank: eight}\n", "lora.rank: --lora-rank must be int, got 'eight'"),
    ("lora: {ranks: 8}\n", "unknown key lora.ranks"),
    ("loraa: {rank: 8}\n", "unknown section 'loraa'"),
    ("- rank\n", "expected a mapping of sections"),
    ("lora: [1]\n", "section 'lora' must be a mapping"),
    ("lora: {rank: [\n", "not valid YAML"),
])
def test_bad_yaml_is_one_line_naming_file_key_or_flag(tmp_path, text, needle):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_command_line(["--config", str(path)], prog="t", description="", world_size=0)
    message = str(err.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "--global-batch-size 6"),
    (["--recompute-modules", "moe"], "--recompute-modules needs --recompute-granularity"),
    (["--save-base", "x"], "--save-base needs --finetune-mode full"),
    (["--lr-warmup-iters", "200"], "--lr-warmup-iters 200 must be below --train-iters 200"),
    (["--moe-token-dispatcher-type", "pigeon"], "moe.token_dispatcher_type"),
    (["--lora-target-modules", "router", "router"], "names a target twice"),
    (["--moe-routing-kl-coeff", "0.1", "--finetune-mode", "full"],
     "--moe-routing-kl-coeff needs --finetune-mode lora"),
    (["--moe-monitor-min-tokens", "-1"], 
     "monitor.min_routed_tokens: --moe-monitor-min-tokens must be >= 0"),
    (["--hf-checkpoint", "hf/", "--base-checkpoint", "b/"],
     "model.hf_checkpoint: --hf-checkpoint and --base-checkpoint are exclusive"),
    (["--hf-checkpoint", "hf/", "--model-config", "small"],
     "model.hf_checkpoint: --hf-checkpoint and --model-config are exclusive"),
    (["--hf-unmap-mib", "0"], "model.hf_unmap_mib: --hf-unmap-mib must be positive"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, needle):
    with pytest.raises(ConfigError) as err:
        parse_command_line(argv, prog="t", description="", world_size=1)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_command_line_errors_exit_2_with_one_line(capsys):
    from megatron_slmoe.training.finetune import main

    for argv in (["--lora-rank", "x"], ["--no-such-flag"], ["--lora-rank", "0"]):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        err = capsys.readouterr().err
        assert code == 2, argv
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err


def test_every_section_is_described_by_a_whole_sentence_in_help():
    from megatron_slmoe.training.cli import first_sentence

    for cls in RunConfig.sections().values():
        line = first_sentence(cls.__doc__ or "")
        assert line.endswith((".", ")")) and line[0].isupper(), (cls.__name__, line)


def test_a_moe_flag_overrides_the_model_file_field_it_declares_and_only_when_given():
    import dataclasses

    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.moe.config import MoERunConfig, SLMoEConfig
    from megatron_slmoe.training.model_setup import model_config_for_run

    declared = {f.name: f.metadata["overrides"] for f in settings(MoERunConfig)
                if f.metadata["overrides"]}
    assert declared == {"token_dispatcher_type": "dispatcher",
                        "hierarchical_alltoall": "hierarchical_alltoall",
                        "node_size": "node_size", "overlap_chunks": "overlap_chunks"}
    model = SLMoEConfig(dispatcher="allgather", node_size=2, overlap_chunks=3, latent_norm=True)
    assert MoERunConfig().over(model) == model  # nothing given: the model file's values
    given = MoERunConfig(token_dispatcher_type="alltoall", hierarchical_alltoall=True, node_size=8,
                         overlap_chunks=1, routing_kl_coeff=0.5)
    assert given.over(model) == SLMoEConfig(dispatcher="alltoall", hierarchical_alltoall=True,
                                            node_size=8, overlap_chunks=1, latent_norm=True)
    tiny = load_model_config("tiny")
    run = model_config_for_run(tiny, MoERunConfig(node_size=4), "lora", 7)
    assert run.slmoe == dataclasses.replace(tiny.slmoe, node_size=4, freeze_router=True,
                                            distributed_timeout_minutes=7)
    assert model_config_for_run(tiny, MoERunConfig(), "full", 7).slmoe == dataclasses.replace(
        tiny.slmoe, distributed_timeout_minutes=7)
