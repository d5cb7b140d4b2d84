"""Packed instruction rows keep their examples apart: through Megatron-Core's GPTModel (local
DotProductAttention with the block-diagonal mask, restarted position ids), every example of a
packed row gets the per-token losses it gets alone in its own row, as at generation time; with one
causal mask over the row (the old packing) the later examples do not. A model config whose fused
softmax would drop the mask is refused for instruction data."""

import pytest
import torch

from tests.helpers.lora_models import build_model, model_config

pytestmark = pytest.mark.usefixtures("megatron_single_rank")



@pytest.mark.parametrize("embedding", ["rope", "learned_absolute"])
def test_each_packed_example_sees_only_itself(tmp_path_factory, embedding):
    from tests.helpers.lora_models import MODEL_YAML

    from megatron_slmoe.data.instruction import pack_examples, packed_attention_mask, \
        positions_in_segments

    text = MODEL_YAML.replace("position_embedding_type: rope",
                              f"position_embedding_type: {embedding}")
    model = build_model(model_config(tmp_path_factory, text, name=f"packed_{embedding}"), seed=2)
    model.eval()
    gen = torch.Generator().manual_seed(7)
    examples = [(torch.randint(6, 64, (n,), generator=gen).tolist(), [1] * n) for n in (5, 7, 3)]
    seq = 16  # the model's max_sequence_length
    rows, _, segments = pack_examples(examples, seq - 1, pad_id=0)
    assert rows.shape[0] == 1  # all three in one row (15 tokens + padding)
    tokens = torch.from_numpy(rows[:, :-1])
    labels = torch.from_numpy(rows[:, 1:])
    segment_ids = torch.from_numpy(segments[:, :-1])

    def losses(tokens_BS, labels_BS, positions_BS, mask):
        with torch.no_grad():
            return model(tokens_BS, positions_BS, mask, labels=labels_BS)[0]

    packed = losses(tokens, labels, positions_in_segments(segment_ids),
                    packed_attention_mask(segment_ids))
    one_mask = losses(tokens, labels, torch.arange(seq - 1).unsqueeze(0), None)
    start = 0
    for number, (ids, _) in enumerate(examples):
        alone_row = torch.tensor(ids + [0] * (seq - len(ids)))  # padded to the same length
        alone = losses(alone_row[None, :-1], alone_row[None, 1:],
                       torch.arange(seq - 1).unsqueeze(0), None)
        within = slice(start, start + len(ids) - 1)  # targets inside the example
        torch.testing.assert_close(packed[within], alone[:len(ids) - 1], rtol=1e-5, atol=1e-5)
        if number > 0:
            assert not torch.allclose(one_mask[within], alone[:len(ids) - 1], atol=1e-3)
        start += len(ids)


def test_mask_and_positions_by_hand():
    from megatron_slmoe.data.instruction import packed_attention_mask, positions_in_segments

    segment_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert positions_in_segments(segment_ids).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = packed_attention_mask(segment_ids)[0, 0]
    allowed = [[q >= k and segment_ids[0, q] == segment_ids[0, k] for k in range(6)]
               for q in range(6)]
    assert mask.tolist() == [[not a for a in row] for row in allowed]


def test_a_fused_softmax_that_would_drop_the_mask_is_refused(tmp_path):
    from tests.helpers.lora_models import MODEL_YAML

    from megatron_slmoe.training.cli import parse_command_line
    from megatron_slmoe.config.errors import ConfigError
    from megatron_slmoe.training.inputs import prepare_run

    import megatron_slmoe

    path = tmp_path / "fused.yaml"
    path.write_text(MODEL_YAML.replace("  num_layers: 2\n",
                                       "  num_layers: 2\n  masked_softmax_fusion: true\n")
                    .replace("vocab_size: 64", "vocab_size: 512"))  # the shipped tokenizer's
    run = parse_command_line(["--model-config", str(path), "--finetune-mode", "full",
                              "--seq-length", "15"], prog="t", description="", world_size=1).run
    with pytest.raises(ConfigError, match="masked_softmax_fusion: true would drop the attention"):
        prepare_run(run, 1, megatron_slmoe.PLATFORM)
    pretrain = run.replace("data", format="pretrain")
    prepare_run(pretrain, 1, megatron_slmoe.PLATFORM)  # one causal mask: nothing to drop
