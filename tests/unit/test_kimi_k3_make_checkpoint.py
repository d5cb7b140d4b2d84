"""slmoe-make-hf-checkpoint --preset kimi-k3 / kimi-k3-tiny (issue 40 item 2): a K3 text
checkpoint in the release's layout (experts MXFP4, fp32 tensors fp32, A_log zero-padded to 128,
1-based layer lists). The tiny one, read by the plain K3 reference under the release's names
(tests/helpers/kimi_k3_reference: its own MXFP4 decoder), gives the logits of our import; a
realistic-width one that this machine's memory cannot hold is refused with the bytes it needs.
Bad K3 checkpoints made from it are one line and exit code 2 from slmoe-convert-hf import."""

import json
import shutil

import pytest
import torch

from megatron_slmoe.commands import convert_hf, make_hf_checkpoint
from tests.helpers import hf_models
from tests.helpers import kimi_k3_reference as k3ref


def _read(directory) -> dict:
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return state


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3make") / "tiny"
    assert make_hf_checkpoint.main(["--preset", "kimi-k3-tiny", "--num-layers", "13",
                                    "--output", str(out)]) == 0
    return out


def test_tiny_checkpoint_has_the_release_layout(tiny):
    config = json.loads((tiny / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert text["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 13]
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
    state = _read(tiny)
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(state)
    m = "language_model.model.layers"
    w1 = f"{m}.1.block_sparse_moe.experts.7.w1.weight"
    assert state[w1 + "_packed"].dtype == torch.uint8 and state[w1 + "_packed"].shape == (32, 16)
    assert state[w1 + "_scale"].shape == (32, 1)
    assert state[f"{m}.1.block_sparse_moe.experts.0.w2.weight_packed"].shape == (32, 16)
    a_log = state[f"{m}.0.self_attn.A_log"]
    assert a_log.dtype == torch.float32 and a_log.shape == (128,)
    assert bool((a_log[4:] == 0).all()) and bool((a_log[:4] > 0).all())
    for name in ("q_conv1d.weight", "dt_bias", "o_norm.weight"):
        assert state[f"{m}.0.self_attn.{name}"].dtype == torch.float32
    assert state[f"{m}.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert f"{m}.3.self_attn.kv_a_proj_with_mqa.weight" in state  # 1-based 4: MLA
    assert f"{m}.0.mlp.gate_proj.weight" in state and f"{m}.0.block_sparse_moe.gate.weight" \
        not in state
    assert not any(".experts." in k and k.endswith(".weight") for k in state)


def test_tiny_checkpoint_imports_with_the_reference_logits(tiny, megatron_single_rank):
    config = json.loads((tiny / "config.json").read_text())
    reference = k3ref.KimiK3Reference(k3ref.KimiK3TextConfig.from_text_config(
        config["text_config"]))
    reference.load_state_dict(k3ref.dequantise_release_state_dict(_read(tiny)), strict=True)
    input_ids = hf_models.tokens(batch=2, seq=12) % 128
    logits, report = hf_models.import_and_run(str(tiny), input_ids)
    with torch.no_grad():
        reference_fp32 = reference.eval()(input_ids).double()
        expected = reference.double()(input_ids)
    assert expected.std() > 0.3  # logits of unit scale: the comparison is not of zeros
    # The writer's unit-gain weights make 13 layers less well conditioned than the reference's
    # own draw (tests/unit/test_kimi_k3.py): the reference's fp32 run lies about 7e-5 from its
    # fp64 one here. Ours must be as close as that.
    own_drift = (reference_fp32 - expected).abs().max().item()
    ours = (logits.double() - expected).abs().max().item()
    assert ours <= max(2 * own_drift, 1e-5) and ours < 2e-4, (ours, own_drift)
    assert report.tensors > 100


def test_realistic_width_is_refused_with_the_bytes_it_needs(tmp_path, capsys, monkeypatch):
    """Layer 1 of K3 (KDA, latent MoE) in bf16, from the tensor table: its stored bytes (896
    experts of 17,547,264 bytes as released) and the scratch of one block of drawn rows (2^22
    elements, 16 bytes each: hf.kimi_k3_release.DRAW_ELEMENTS, DRAW_SCRATCH)."""
    H, P, L = 7168, 12288, 3584
    stored = (6 * H * 2 + 4 * P * H * 2 + 3 * P * 4 * 4 + 128 * H * 2 + P * 128 * 2 + 128 * 4
              + P * 4 + 96 * H * 2 + 128 * 4 + H * P * 2
              + 896 * H * 2 + 896 * 4 + 2 * L * H * 2 + L * 2 + 3 * 6144 * H * 2
              + 896 * 17_547_264)
    needed = stored + 2**22 * 16
    monkeypatch.setattr(make_hf_checkpoint, "_available_memory", lambda: 8 * 2**30)
    out = tmp_path / "k3"
    assert make_hf_checkpoint.main(["--preset", "kimi-k3", "--num-layers", "3", "--dtype",
                                    "bf16", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"({needed:,} bytes)" in err and "layer 1" in err, err
    assert not out.exists()


@pytest.mark.parametrize("change, fragment", [
    ("num_experts=1", "larger than --num-experts 1"),  # fewer experts than the top-k
    ("moe_intermediate_size=48", "multiple of 32"),
    ("linear_attn_config.nope=1", "'linear_attn_config.nope' is not a field"),
])
def test_bad_set_is_one_line(tmp_path, capsys, change, fragment):
    out = tmp_path / "k3"
    assert make_hf_checkpoint.main(["--preset", "kimi-k3-tiny", "--num-layers", "3", "--set",
                                    change, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err
    assert not out.exists()


# --- bad K3 checkpoints through slmoe-convert-hf import ---------------------------------------

M = "language_model.model.layers"


def _edit_tensors(directory, edit) -> None:
    """Apply ``edit(state)`` to every shard (in place), and drop removed keys from the index."""
    from safetensors.torch import load_file, save_file

    for shard in directory.glob("*.safetensors"):
        state = load_file(str(shard))
        edit(state)
        save_file(state, str(shard), metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    present = set(_read(directory))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in present}
    index_path.write_text(json.dumps(index))


def _edit_config(directory, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config["text_config"])
    path.write_text(json.dumps(config))


def _layer_lists(directory):
    def edit(text):
        text["linear_attn_config"]["kda_layers"].append(4)  # 4 is also a full-attention layer
    _edit_config(directory, edit)


def _wrong_packed_size(directory):
    key = f"{M}.2.block_sparse_moe.experts.3.w1.weight_packed"

    def edit(state):
        if key in state:
            state[key] = state[key][:, :8].contiguous()
    _edit_tensors(directory, edit)


def _packed_pair_of_another_width(directory):
    # Packed bytes and scales that agree with each other, for 64 inputs where the config has 32.
    key = f"{M}.2.block_sparse_moe.experts.3.w1.weight"

    def edit(state):
        if key + "_packed" in state:
            for part in ("_packed", "_scale"):
                state[key + part] = torch.cat([state[key + part]] * 2, 1)
    _edit_tensors(directory, edit)


def _scale_missing(directory):
    key = f"{M}.2.block_sparse_moe.experts.3.w2.weight_scale"
    _edit_tensors(directory, lambda state: state.pop(key, None))


def _nonzero_padding(directory):
    key = f"{M}.1.self_attn.A_log"

    def edit(state):
        if key in state:
            state[key][100] = 0.5
    _edit_tensors(directory, edit)


def _too_many_heads(directory):
    # 130 KDA heads of width 8 need A_log in 256 slots; the checkpoint stores 128.
    _edit_config(directory, lambda text: text["linear_attn_config"].update(num_heads=130))


BAD = {
    "layer-lists": (_layer_lists, ["full_attn_layers and kda_layers must split"]),
    "packed-size": (_wrong_packed_size, ["experts.3.w1.weight"]),
    "packed-width": (_packed_pair_of_another_width,
                     ["experts.3.w1.weight has shape [32, 64]", "implies [32, 32]"]),
    "scale-missing": (_scale_missing, ["experts.3.w2.weight"]),
    "a-log-padding": (_nonzero_padding, ["layers.1.self_attn.A_log", "not zero"]),
    "heads-padding": (_too_many_heads, ["A_log"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_k3_checkpoint_is_one_line_and_exit_2(tiny, tmp_path, capsys, case):
    make, fragments = BAD[case]
    directory = tmp_path / "bad"
    shutil.copytree(tiny, directory)
    make(directory)
    out = tmp_path / "out"
    assert convert_hf.main(["import", "--hf-checkpoint", str(directory), "--output",
                            str(out)]) == 2
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not out.exists()
