"""Benchmark a K3-shaped pair of decoder layers' LoRA training step on CPU: ours against the same
shapes assembled from transformers' ``kimi_linear`` modules with PEFT.

Both variants are two decoder layers (one Kimi Delta Attention layer, one MLA layer, each with a
latent MoE: a sigmoid router on the hidden state, routed experts in a narrower latent, a shared
expert at the hidden width) between an embedding and an output layer, float32, LoRA rank 8:

  ours          the package's Kimi K3 model built from a release-style K3 ``text_config`` (the
                family's ModelConfig, Megatron-Core's GPTModel with our KDA, gated NoPE MLA,
                Attention Residuals and latent MoE), LoRA on ``linear_qkv``, ``linear_proj``,
                ``linear_fc1``, ``linear_fc2`` (attention input and output projections, every
                routed expert's fc1 and fc2)
  transformers  ``KimiLinearDecoderLayer`` x 2 (its KDA ``KimiLinearDeltaAttention`` and MLA
                ``KimiLinearAttention``, sdpa) whose MLP is replaced by the same latent MoE
                made of its parts: ``KimiLinearTopkRouter`` on the hidden state, ``nn.Linear``
                down to the latent, ``KimiLinearExperts`` (its per-expert loop) in the latent,
                ``nn.Linear`` back up, ``KimiLinearMLP`` as the shared expert; PEFT LoRA on the
                attention projections (KDA q/k/v/o_proj; MLA q_a/q_b/kv_a/kv_b/o_proj) and
                on the experts' ``gate_up_proj`` and ``down_proj`` (``target_parameters``)

Where they differ (said so the ratios are read right): ours adapts more of KDA under
``linear_qkv`` (also its gate, beta and decay projections) and has K3's MLA output gate, Attention
Residuals and SiTU; transformers' has none of those (silu). ``lora_params`` gives each variant's
adapter size.

Each variant runs in its own subprocess, twice: once only importing and building (the baseline)
and once also timing --reps forward+backward steps after --warmup (loss: cross-entropy on random
labels, no optimizer step). ``tok_s`` = batch x tokens / median step wall time; ``peak_mib`` = the
step process's ru_maxrss minus the baseline's; ``x_vs_transformers`` = ours over transformers in
the same run (tok_s: above 1 ours is faster; peak: below 1 ours uses less). The 1-minute load
average before and after each variant's step process is printed and recorded.

    python tools/bench/k3_layer.py                   # hidden 512, seq 1024 (a quiet machine)
    python tools/bench/k3_layer.py --quick           # tiny shapes, one step: a smoke run
    python tools/bench/k3_layer.py --json runs/bench/k3_layer.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("ours", "transformers")
LORA_RANK, LORA_ALPHA = 8, 16.0


def text_config(a) -> dict:
    """A release-style K3 ``text_config`` (the keys the family reads) of two MoE layers: layer 1
    KDA, layer 2 MLA (1-based, as the release numbers them)."""
    return {
        "model_type": "kimi_linear", "vocab_size": a.vocab, "hidden_size": a.hidden,
        "num_hidden_layers": 2, "intermediate_size": 2 * a.hidden, "rms_norm_eps": 1e-5,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2, "num_attention_heads": a.mla_heads,
        "num_key_value_heads": a.mla_heads, "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.head_dim,
        "qk_rope_head_dim": a.head_dim // 2, "v_head_dim": a.head_dim,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": a.kda_heads, "head_dim": a.head_dim,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True, "full_attn_layers": [2],
                               "kda_layers": [1]},
        "num_experts": a.experts, "num_experts_per_token": a.topk, "num_shared_experts": 1,
        "moe_intermediate_size": a.expert_ffn, "routed_expert_hidden_size": a.latent,
        "latent_moe_use_norm": False, "first_k_dense_replace": 0, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1,
        "tie_word_embeddings": False,
    }


# --- the variants (built and run in a child process) ---------------------------------------------


def build_ours(a):
    """(model, step(input_ids, labels) -> loss)."""
    import torch

    from megatron_slmoe.families.kimi_k3.family import KimiK3Family
    from megatron_slmoe.model.build import build_gpt_model
    from megatron_slmoe.lora.config import LoRAConfig
    from megatron_slmoe.lora.inject import inject_lora
    from megatron_slmoe.platform.single_rank import init_single_rank

    init_single_rank()
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "tie_word_embeddings": False, "text_config": text_config(a)}
    model_config = KimiK3Family().model_config(config, "k3_layer_bench/config.json")
    model = build_gpt_model(model_config,
                            model_config.transformer_config(use_cpu_initialization=True))
    inject_lora([model], LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA,
                                    targets=["linear_qkv", "linear_proj", "linear_fc1",
                                             "linear_fc2"]))
    position_ids = torch.arange(a.seq).expand(a.batch, a.seq)

    def step(input_ids, labels):
        return model(input_ids, position_ids, None, labels=labels).mean()

    return model, step


def _latent_moe_class():
    import torch
    from transformers.models.kimi_linear import modeling_kimi_linear as kl

    class TransformersLatentMoE(torch.nn.Module):
        """K3's latent MoE from transformers' parts: route on the hidden state, run the experts
        in the latent, add the shared expert at the hidden width."""

        def __init__(self, hidden_config, latent_config):
            super().__init__()
            self.gate = kl.KimiLinearTopkRouter(hidden_config)
            self.latent_down = torch.nn.Linear(hidden_config.hidden_size,
                                               latent_config.hidden_size, bias=False)
            self.experts = kl.KimiLinearExperts(latent_config)
            self.latent_up = torch.nn.Linear(latent_config.hidden_size,
                                             hidden_config.hidden_size, bias=False)
            self.shared_experts = kl.KimiLinearMLP(
                hidden_config, intermediate_size=hidden_config.moe_intermediate_size)

        def forward(self, hidden_states):
            shape = hidden_states.shape
            _, weights, indices = self.gate(hidden_states)
            latent = self.latent_down(hidden_states.reshape(-1, shape[-1]))
            routed = self.latent_up(self.experts(latent, indices, weights.to(latent.dtype)))
            return routed.view(shape) + self.shared_experts(hidden_states)

    return TransformersLatentMoE


def build_transformers(a):
    import logging

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers.models.kimi_linear import modeling_kimi_linear as kl
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    logging.getLogger("transformers").setLevel(logging.ERROR)  # "fla missing": the torch path
    fields = {k: v for k, v in text_config(a).items() if k not in ("hidden_act", "model_type")}
    hidden_config = KimiLinearConfig(**fields, hidden_act="silu",
                                     layer_types=["linear_attention", "full_attention"],
                                     mlp_layer_types=["sparse", "sparse"])
    hidden_config._attn_implementation = "sdpa"
    latent_config = KimiLinearConfig(**{**fields, "hidden_size": a.latent}, hidden_act="silu",
                                     layer_types=["linear_attention", "full_attention"],
                                     mlp_layer_types=["sparse", "sparse"])
    moe = _latent_moe_class()

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(a.vocab, a.hidden)
            self.layers = torch.nn.ModuleList(
                kl.KimiLinearDecoderLayer(hidden_config, i) for i in range(2))
            for layer in self.layers:
                layer.mlp = moe(hidden_config, latent_config)
            self.norm = kl.KimiLinearRMSNorm(a.hidden)
            self.lm_head = torch.nn.Linear(a.hidden, a.vocab, bias=False)

        def forward(self, input_ids, labels):
            hidden = self.embed_tokens(input_ids)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=None)
            logits = self.lm_head(self.norm(hidden))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    stack = Stack()
    with torch.no_grad():  # its modules leave some weights empty (router zeros, experts empty)
        gen = torch.Generator().manual_seed(0)
        for name, param in stack.named_parameters():
            if param.dim() >= 2:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    model = get_peft_model(stack, LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                        "kv_a_proj_with_mqa", "kv_b_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    return model, model


def child(a) -> dict:
    import torch

    torch.manual_seed(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, step = (build_ours if a.child == "ours" else build_transformers)(a)
    out = dict(lora_params=sum(p.numel() for p in model.parameters() if p.requires_grad))
    if a.measure == "step":
        gen = torch.Generator().manual_seed(1)
        input_ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
        labels = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
        walls, cpus = [], []
        for rep in range(a.warmup + a.reps):
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = step(input_ids, labels)
            loss.backward()
            if rep >= a.warmup:
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu_start)
            model.zero_grad(set_to_none=True)
        out.update(ms=1e3 * statistics.median(walls), cpu_ms=1e3 * statistics.median(cpus),
                   loss=float(loss.detach()))
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


# --- the parent ----------------------------------------------------------------------------------


def run_child(a, variant: str, measure: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", variant, "--measure", measure]
    for name in ("hidden", "latent", "kda_heads", "mla_heads", "head_dim", "q_lora_rank",
                 "kv_lora_rank", "experts", "topk", "expert_ffn", "vocab", "seq", "batch",
                 "warmup", "reps", "threads"):
        value = getattr(a, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{variant} ({measure}) failed: {tail}")
    return json.loads(lines[-1])


def shapes(a) -> str:
    return (f"hidden {a.hidden}, KDA {a.kda_heads}x{a.head_dim}, MLA {a.mla_heads} heads "
            f"(q_lora {a.q_lora_rank}, kv_lora {a.kv_lora_rank}, head {a.head_dim}), "
            f"{a.experts} experts top-{a.topk} of ffn {a.expert_ffn} in a {a.latent} latent "
            f"+ 1 shared, vocab {a.vocab}, batch {a.batch} x seq {a.seq}, LoRA rank {LORA_RANK}")


COLUMNS = (("variant", 13, "{}"), ("ms", 10, "{:.1f}"), ("cpu_ms", 10, "{:.1f}"),
           ("tok_s", 9, "{:.0f}"), ("peak_mib", 9, "{:.0f}"), ("lora_params", 12, "{}"),
           ("x_tok_s_vs_transformers", 24, "{:.2f}"), ("x_peak_vs_transformers", 23, "{:.2f}"),
           ("load_avg_1m", 13, "{0[0]:.1f}->{0[1]:.1f}"))


def format_row(row: dict) -> str:
    return " ".join(f"{fmt.format(row[name]) if name in row else '-':>{width}}"
                    for name, width, fmt in COLUMNS)


def bench(a) -> list[dict]:
    rows = {}
    for variant in a.variants:
        base = run_child(a, variant, "build")
        load_before = os.getloadavg()[0]
        measured = run_child(a, variant, "step")
        rows[variant] = dict(
            variant=variant, shapes=shapes(a), ms=measured["ms"], cpu_ms=measured["cpu_ms"],
            tok_s=a.batch * a.seq / (measured["ms"] / 1e3),
            peak_mib=measured["maxrss_mib"] - base["maxrss_mib"],
            lora_params=measured["lora_params"], loss=measured["loss"],
            load_avg_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)],
            warmup=a.warmup, reps=a.reps)
    if set(VARIANTS) <= set(rows):
        theirs = rows["transformers"]
        for row in rows.values():
            row["x_tok_s_vs_transformers"] = row["tok_s"] / theirs["tok_s"]
            row["x_peak_vs_transformers"] = row["peak_mib"] / max(theirs["peak_mib"], 1e-9)
    return list(rows.values())


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 512), ("latent", 256), ("kda_heads", 4), ("mla_heads", 4),
                          ("head_dim", 128), ("q_lora_rank", 256), ("kv_lora_rank", 256),
                          ("experts", 16), ("topk", 4), ("expert_ffn", 256), ("vocab", 1024),
                          ("seq", 1024), ("batch", 1), ("reps", 5)):
        p.add_argument(f"--{name.replace('_', '-')}", type=_positive, default=default)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=_positive, help="torch's intra-op threads in each child")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes (hidden 128, seq 128), no warm-up, one step: a smoke run")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--measure", choices=("build", "step"), default="step", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.latent, a.head_dim, a.q_lora_rank, a.kv_lora_rank = 128, 64, 32, 64, 64
        a.experts, a.topk, a.expert_ffn, a.vocab, a.seq = 8, 2, 64, 256, 128
        a.warmup, a.reps = 0, 1
    if a.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {a.warmup}")
    if a.topk > a.experts:
        p.error(f"--topk {a.topk} exceeds --experts {a.experts}")
    if a.latent >= a.hidden:
        p.error(f"--latent {a.latent} must be smaller than --hidden {a.hidden}")
    if a.head_dim % 2:
        p.error(f"--head-dim must be even (the MLA rope part is half of it), got {a.head_dim}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    from megatron_slmoe.utils.atomic import write_json_atomic

    print(f"cpu, float32, {shapes(a)}; warmup {a.warmup}, reps {a.reps}; load average "
          f"{os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores", flush=True)
    try:
        rows = bench(a)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(" ".join(f"{name:>{width}}" for name, width, _ in COLUMNS))
    for row in rows:
        print(format_row(row))
    if a.json:
        write_json_atomic(a.json, rows, indent=1)
        print(f"wrote {len(rows)} rows to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
