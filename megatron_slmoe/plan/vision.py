"""The vision tower and projector of an image-text run, priced like the language model.

``VisionShape.from_config(vision, image_text)`` reads the run's ``vision`` and
``image_text`` sections; ``vision_parameters`` counts what Megatron-Core's ``CLIPViTModel`` and
``MultimodalProjector`` hold (a unit test holds it equal to the built modules), and
``vision_memory`` what they add to the first pipeline stage, where LLaVAModel puts them.

The tower sees its own tokens: ``patches (+ class token)`` per tile, ``tiles_per_sample`` tiles
per sample. The language model's sequence already counts the image positions (``--seq-length`` is
the combined length), so its estimate does not change. Frozen tower and projector (the default)
keep nothing for backward: their input needs no gradient. LoRA on ``vision_attention`` or
``projector`` makes autograd keep the layers' activations, as for the language model's layers.

A Hugging Face checkpoint's own vision module (``ReplicatedTower``) is priced from its counts:
its weights whole on each first-stage rank, its adapters, and its activations at the most
patches a micro-batch can hold.

Functions take d, the language model's width (the projector's output). Symbols: h tower width,
F tower MLP width, p patch side, P projector inner width, d language width, s tokens per tile,
n tiles per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

_FP32 = 4


@dataclass(frozen=True)
class VisionShape:
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    patch_dim: int
    patches: int
    """Patches per tile."""
    class_token: bool
    """CLIP's class token (SigLIP has none; it has a conv bias and ln_post instead of ln_pre)."""
    drop_class_token: bool
    """The class token is dropped before the projector."""
    projector: str
    """mlp (fc1 -> GELU -> fc2) or affine."""
    projector_ffn: int
    tiles_per_sample: int
    """Tiles of one sample's image (one image per sample)."""
    activation_tensors: int = 1
    """Tensors the MLP activation keeps for backward per element: quick_gelu (x * sigmoid(1.702
    x)) keeps its input and the sigmoid, gelu its input."""

    @classmethod
    def from_config(cls, vision, image_text) -> "VisionShape":
        """From the run's ``vision`` and ``image_text`` sections."""
        return cls(layers=vision.num_layers, hidden=vision.hidden_size,
                   heads=vision.num_attention_heads, ffn_hidden=vision.ffn_hidden_size,
                   patch_dim=vision.patch_dim,
                   patches=(vision.img_h // vision.patch_dim) * (vision.img_w // vision.patch_dim),
                   class_token=vision.model_type == "clip",
                   drop_class_token=vision.drop_class_token, projector=vision.projector_type,
                   projector_ffn=vision.projector_ffn_hidden_size,
                   tiles_per_sample=image_text.max_tiles + (1 if image_text.thumbnail else 0),
                   activation_tensors=2 if vision.activation == "quick_gelu" else 1)

    @property
    def tokens_per_tile(self) -> int:
        """Tokens the tower sees per tile."""
        return self.patches + (1 if self.class_token else 0)

    @property
    def projected_per_tile(self) -> int:
        """Tokens the projector maps per tile (language positions of a tile)."""
        return self.patches + (1 if self.class_token and not self.drop_class_token else 0)


def _tower_split(v: VisionShape) -> tuple[int, int]:
    """(tensor-parallel parameters, replicated parameters) of the tower."""
    h, f = v.hidden, v.ffn_hidden
    per_layer_split = 3 * h * h + 3 * h + h * h + h * f + f + f * h  # qkv, proj, fc1, fc2, biases
    per_layer_replicated = 2 * h + 4 * h  # proj and fc2 biases, two LayerNorms (weight, bias)
    # conv1, position embeddings, and either CLIP's class token and ln_pre or SigLIP's conv1
    # bias and ln_post (h + 2h both ways)
    embed = 3 * v.patch_dim ** 2 * h + v.tokens_per_tile * h + 3 * h
    return v.layers * per_layer_split, v.layers * per_layer_replicated + embed


def _projector_split(v: VisionShape, d: int) -> tuple[int, int]:
    """(tensor-parallel parameters, replicated parameters) of the projector into width d."""
    h, p = v.hidden, v.projector_ffn
    if v.projector == "affine":
        return h * d + d, 0
    return h * p + p + p * d, d  # fc1 (column), fc2 (row; its bias replicated)


def vision_parameters(v: VisionShape, language_hidden: int) -> dict[str, int]:
    """Parameters of the tower and the projector (whole model, no parallelism)."""
    return {"vision_tower": sum(_tower_split(v)),
            "projector": sum(_projector_split(v, language_hidden))}


def vision_lora_parameters(v: VisionShape, d: int, targets, rank: int, tp: int) -> int:
    """LoRA parameters on one rank for the ``vision_attention`` / ``projector`` targets: A [r, in]
    and B [out, r] per adapted linear (column-parallel: B split; row-parallel: A split)."""
    h, p = v.hidden, v.projector_ffn
    total = 0
    if "vision_attention" in targets:  # linear_qkv (column), linear_proj (row)
        total += v.layers * (rank * h + 3 * h // tp * rank + rank * h // tp + h * rank)
    if "projector" in targets:
        if v.projector == "affine":
            total += rank * h + d // tp * rank
        else:  # fc1 (column), fc2 (row)
            total += rank * h + p // tp * rank + rank * p // tp + d * rank
    return total


def vision_weights(v: VisionShape, d: int, tp: int) -> tuple[int, int]:
    """(run-dtype parameters, fp32 LayerNorm parameters) of tower and projector on one rank."""
    tower_split, tower_rest = _tower_split(v)
    proj_split, proj_rest = _projector_split(v, d)
    norms = v.layers * 4 * v.hidden + 2 * v.hidden  # two per layer, plus ln_pre or ln_post
    return tower_split // tp + tower_rest - norms + proj_split // tp + proj_rest, norms


def vision_activations(v: VisionShape, d: int, targets, rank: int, tp: int,
                       micro_batch_size: int, element_size: int) -> tuple[int, int]:
    """(kept for backward, forward working set) of one micro-batch's images on one rank.

    Kept: nothing unless LoRA adapts the tower's attention or the projector (the base weights
    are frozen, so a frozen linear keeps nothing). LoRA on the attention: per layer, the LayerNorm
    inputs (fp32, with mean and rstd; not the first layer's first, whose input needs no gradient;
    SigLIP's ln_post too),
    qkv's LoRA input and r-wide intermediate, q/k/v, the softmax probabilities, the context
    (proj's LoRA input) and its r-wide intermediate, and what the MLP activation keeps; then the
    projector's GELU input. LoRA on the projector: the LoRA inputs and intermediates of its
    linears and the GELU's input. The working set: one layer's forward at a time (the frozen
    case's peak on top)."""
    b, h, f, r = element_size, v.hidden, v.ffn_hidden, rank
    tiles = micro_batch_size * v.tiles_per_sample
    tokens = tiles * v.tokens_per_tile
    projected = tiles * v.projected_per_tile
    probs = _FP32 + (b if b < _FP32 else 0)
    softmax = v.heads // tp * v.tokens_per_tile ** 2 * tiles * probs
    layer = (2 * (_FP32 * h + _FP32) * tokens + (3 * h // tp + h // tp) * b * tokens + softmax
             + (h + 2 * f // tp) * b * tokens)  # one layer's forward (the working set)
    working = layer
    kept = 0
    if "vision_attention" in targets:
        norm = _FP32 * (h + 2) * tokens
        attention = (h + 3 * h // tp + h // tp + 2 * r) * b * tokens + softmax
        mlp = v.activation_tensors * f // tp * b * tokens
        kept += v.layers * (2 * norm + attention + mlp) - norm
        if not v.class_token:  # SigLIP's ln_post after the layers (CLIP's ln_pre keeps nothing)
            kept += norm
    p = 0 if v.projector == "affine" else v.projector_ffn // tp
    if "projector" in targets:  # affine: its LoRA input; mlp: fc1's, the GELU's and fc2's inputs
        kept += (h + r if v.projector == "affine" else h + 2 * p + 2 * r) * b * projected
    elif "vision_attention" in targets:
        kept += p * b * projected  # the GELU's input
    if "projector" in targets or "vision_attention" in targets:
        working = max(working, (h + 2 * p + d) * b * projected)
    return kept, working


@dataclass(frozen=True)
class ReplicatedTower:
    """A checkpoint's own vision module (transformers' tower and projector, e.g. Kimi-K2.5's
    MoonViT): whole on every rank of the first pipeline stage, in the run's dtype, frozen unless
    LoRA adapts it. Its counts come from the module built on the meta device
    (``hf.tower_model.vision_census``)."""

    parameters: int
    lora_parameters: int
    """Adapter parameters of the run's targets on it (each rank holds them whole)."""
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    patches_per_position: int
    """Patches merged into one language position (Kimi-K2.5: 2 x 2)."""
    attention_adapted: bool = False
    """LoRA on ``vision_attention``: backward runs through every tower layer."""
    projector_adapted: bool = False
    images: bool = True
    """The run reads images (--task image-text); a text run on the checkpoint has the tower
    too, and runs it only when it trains (on one blank merged patch per micro-batch)."""

    def patches(self, seq_length: int, micro_batch_size: int) -> int:
        """Patches of one micro-batch at most. With images: every position an image position
        (native-resolution images have no fixed size, so this ceiling is what the check can
        know); without: the blank merged patch a trained tower runs on, else none."""
        if self.images:
            return micro_batch_size * seq_length * self.patches_per_position
        trained = self.attention_adapted or self.projector_adapted
        return self.patches_per_position if trained else 0


def tower_activations(t: ReplicatedTower, patches: int, rank: int,
                      element_size: int) -> tuple[int, int]:
    """(kept for backward, forward working set) of ``patches`` patches through a MoonViT-style
    tower (pre-norm blocks, 2D rotary q/k, attention per image through SDPA: no S^2 scores) and
    its projector (LayerNorm, 2x2 merge, linear, GELU, linear).

    Kept with LoRA on the tower's attention, per layer and patch: the two LayerNorm inputs and
    their mean and rstd (fp32), q/k/v's input (the first norm's output) and their r-wide LoRA
    intermediates, q, k, v and the attention output (SDPA's, and its contiguous copy that the
    output projection takes), the output projection's r-wide intermediate, the logsumexp per
    head (fp32), the MLP activation's input; once: the final LayerNorm's input (fp32) and the
    projector LayerNorm's, their stats, the projector GELU's input, the rotary cos and sin
    (fp32), the position index (int64). With LoRA on the projector: its two linears' inputs and
    r-wide intermediates (per merged position), and, alone, the GELU's input. Held equal to what
    autograd keeps in ``tests/unit/test_plan_vision.py`` (fp32; bf16 within CPU's LayerNorm
    stats, which CUDA keeps in fp32 as priced). Working set, an estimate not measured: one
    layer's forward (its input, q, k, v, the attention output, the MLP's inner activation)."""
    b, h, f, r, m = element_size, t.hidden, t.ffn_hidden, rank, t.patches_per_position
    per_patch = 0.0
    if t.attention_adapted:
        per_patch += t.layers * ((8 * h + f + 4 * r) * b + (t.heads + 4) * _FP32)
        per_patch += 2 * h * b + (h + 2 * (h // t.heads) + 5) * _FP32
        if t.projector_adapted:
            per_patch += (2 * h + 2 * r / m) * b
    elif t.projector_adapted:
        per_patch += (3 * h + 2 * r / m) * b
    working = (5 * h + f) * b * patches
    return int(per_patch * patches), working
