"""Directories written whole or not at all (utils.atomic): a replaced directory is the old or the
new one at every moment, and a crash in the middle of replacing a base checkpoint leaves a
complete base behind."""

from __future__ import annotations

import os
import shutil

import pytest

from megatron_slmoe.utils import atomic
from megatron_slmoe.utils.atomic import atomic_directory, promote_directory, staging_directory


def _tree(path) -> dict[str, str]:
    return {name: open(os.path.join(path, name)).read() for name in sorted(os.listdir(path))}


def test_replacing_exchanges_in_one_step_and_leaves_no_staging(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as staging:
        (tmp_path / staging / "a.txt").write_text("old")
    with atomic_directory(target, replace=True) as staging:
        (tmp_path / staging / "b.txt").write_text("new")
    assert _tree(target) == {"b.txt": "new"}
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_crash_right_after_the_swap_leaves_the_new_directory(tmp_path, monkeypatch):
    """The old directory is deleted after the swap; dying there costs nothing but disk."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.txt").write_text("old")
    staging = staging_directory(target)
    with open(os.path.join(staging, "b.txt"), "w") as f:
        f.write("new")

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        promote_directory(staging, target, replace=True)
    assert _tree(target) == {"b.txt": "new"}


def test_without_an_atomic_exchange_the_old_directory_is_kept_aside(tmp_path, monkeypatch):
    """Where the file system cannot exchange two names, a crash between the two renames leaves
    the old directory complete under a hidden name beside it."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.txt").write_text("old")
    staging = staging_directory(target)
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    renames = []

    def replace_then_crash(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt("killed")
        os.rename(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_crash)
    with pytest.raises(KeyboardInterrupt):
        promote_directory(staging, target, replace=True)
    kept = [p for p in os.listdir(tmp_path) if p.startswith(".out.old-")]
    assert len(kept) == 1 and _tree(tmp_path / kept[0]) == {"a.txt": "old"}


def test_a_crash_while_replacing_a_base_checkpoint_leaves_a_complete_base(
        tmp_path, monkeypatch, megatron_single_rank):
    """save_base_checkpoint over an existing base: the old base stays until the new one is whole
    (before, it was deleted first, and a crash before the rename left no base at all)."""
    from megatron_slmoe.data.assets import asset_path
    from megatron_slmoe.data.tokenizer import load_tokenizer
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.model.model_file import load_model_config
    from megatron_slmoe.training.checkpointing import save_base_checkpoint, verify

    config = load_model_config("tiny")
    model = build_gpt_model(config, config.transformer_config(use_cpu_initialization=True))
    tokenizer = load_tokenizer(asset_path("tokenizer.json"))
    base = tmp_path / "base"
    save_base_checkpoint(model, str(base), "tiny", tokenizer)
    assert verify(str(base)) is None

    def crash_before_promoting(*_args, **_kwargs):
        raise KeyboardInterrupt("killed while replacing the base")

    from megatron_slmoe.training import checkpointing

    monkeypatch.setattr(checkpointing, "promote_directory", crash_before_promoting)
    with pytest.raises(KeyboardInterrupt):
        save_base_checkpoint(model, str(base), "tiny", tokenizer)
    assert verify(str(base)) is None  # the previous base, whole
