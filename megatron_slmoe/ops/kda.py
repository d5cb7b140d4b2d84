"""The delta-rule recurrence with per-channel decay that Kimi Delta Attention (KDA) runs.

For each batch row and head, with the state S [K, V] (zero, or ``initial_state``) and per token t::

    S  <- diag(exp(g_t)) S                         g_t [K]: log-decay per key channel, <= 0
    S  <- S + beta_t k_t (v_t - S^T k_t)^T          the delta rule (beta_t a scalar in [0, 1])
    o_t = scale * S^T q_t                           read from the updated state

Tensors are batch-major as fla's kernels take them: q, k, g [B, T, H, K]; v [B, T, H, V];
beta [B, T, H]; states [B, H, K, V] in float32. The output has v's dtype, the arithmetic is float32
(float64 inputs stay float64). ``qk_l2norm`` normalises q and k per head first (x / sqrt(sum x^2 +
1e-6), fla's rule).

Three implementations of the same maths:

* :func:`kda_recurrent` - one step per token, the obvious reference;
* :func:`kda_chunked` - chunks of 64 tokens in the WY/UT form, pure torch with autograd: fast on CPU
  and the reference of the fused kernel;
* fla-core's ``chunk_kda`` (triton) on CUDA where ``fla`` is importable.

:func:`kda` picks one (:func:`kda_backend` is the one place that decides).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from megatron_slmoe.ops._native import KERNELS_ENV

CHUNK_SIZE = 64
_SPLIT = 4  # a chunk's decayed scores: blocks of a quarter, recursively ...
_LEAF = 4  # ... down to blocks of 4 tokens, taken pair by pair
L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _check(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != g.shape:
        raise ValueError(f"kda: q, k and g must share a shape [B, T, H, K], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"kda: v must be [B, T, H, V] with q's B, T, H {tuple(q.shape[:3])}, "
                         f"got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"kda: beta must be [B, T, H] = {list(q.shape[:3])}, got "
                         f"{tuple(beta.shape)}")
    if initial_state is not None:
        want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"kda: initial_state must be [B, H, K, V] = {list(want)}, got "
                             f"{tuple(initial_state.shape)}")


def _prepared(q, k, v, g, beta, scale: float | None, qk_l2norm: bool):
    """What both paths compute with: every input in float32 (float64 stays float64), q and k
    L2-normalised where asked, q times ``scale`` (default K^-0.5)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def kda_recurrent(q, k, v, g, beta, scale: float | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  qk_l2norm: bool = False):
    """The recurrence token by token: ``(o [B, T, H, V], final state [B, H, K, V] or None)``."""
    _check(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, g, beta = _prepared(q, k, v, g, beta, scale, qk_l2norm)
    S = (q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(q.dtype))
    outputs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, S)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - predicted)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)


def _decayed_scores(a_list, b, G, inclusive_list):
    """For each a of ``a_list``: M[t, s] = sum_c a[t, c] b[s, c] exp(G[t, c] - G[s, c]) for s < t
    (s <= t where its ``inclusive``), 0 elsewhere, per chunk: a, b [..., C, K], G [..., C, K]
    (float64) -> [..., C, C]. The decays are computed once for all of a_list (K3: keys and
    queries against the same keys).

    G is a cumulative log-decay, falling along the chunk, so exp(G_t - G_s) <= 1 where it is used.
    Taking it pair by pair costs C x C x K; factoring it as exp(G_t - r) exp(r - G_s) makes it a
    matmul, exact when both exponents are <= 0, i.e. when r lies between s and t (a common r for a
    whole chunk would overflow: K3's decays reach exp(-320) within one). So the chunk is cut into
    4 blocks: pairs in different blocks (t in I > J, s in J) take r = G at the end of block J (a
    matmul per block pair); pairs inside a block are the same problem, one level down, until blocks of
    _LEAF tokens take their pairs one by one. Exponents are differences of the float64 G, so
    they are exact to float32's precision of the difference, not of G."""
    *lead, C, K = b.shape
    dtype = b.dtype
    if C <= _LEAF or C % _SPLIT:
        # [..., C(t), C(s), K]; the exponent is clamped where the pair is masked anyway.
        decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).to(dtype).clamp_(max=0).exp_()
        b_decayed = b.unsqueeze(-3) * decay
        out = []
        for a, inclusive in zip(a_list, inclusive_list):
            M = (a.unsqueeze(-2) * b_decayed).sum(-1)
            keep = torch.ones(C, C, dtype=torch.bool, device=b.device).tril(0 if inclusive else -1)
            out.append(M.masked_fill(~keep, 0))
        return out
    n, S = _SPLIT, C // _SPLIT
    split = [x.reshape(*lead, n, S, K) for x in a_list]
    within = _decayed_scores(split, b.reshape(*lead, n, S, K), G.reshape(*lead, n, S, K),
                             inclusive_list)  # each [..., n, S, S]
    G_b = G.reshape(*lead, n, S, K)
    end = G_b[..., -1:, :]  # [..., n(J), 1, K]: the decay at the end of block J
    first = G_b[..., :1, :]  # [..., n(I), 1, K]: at the start of block I
    b_scaled = b.reshape(*lead, n, S, K) * (end - G_b).to(dtype).exp()  # exponent <= 0
    # exp(G_t - end_J) for t in I > J, as exp(G_t - first_I) exp(first_I - end_J): two factors
    # <= 1, the second one per block pair [..., n(I), n(J), K] (clamped where I <= J: masked).
    from_first = (G_b - first).to(dtype).exp()
    between = (first - end.transpose(-3, -2)).to(dtype).clamp_(max=0).exp_()
    later = torch.ones(n, n, dtype=torch.bool, device=b.device).tril(-1)  # I > J
    later = later.to(dtype).view(n, 1, n, 1)
    # Block-diagonal placement: [..., n(I), S, n(J), S], J = I only.
    block_eye = torch.eye(n, dtype=dtype, device=b.device).view(n, 1, n, 1)
    out = []
    for a_b, block_scores in zip(split, within):
        a_scaled = (a_b * from_first).unsqueeze(-3) * between.unsqueeze(-2)  # [..., I, J, S, K]
        across = a_scaled @ b_scaled.unsqueeze(-4).transpose(-1, -2)  # [..., I, J, S(t), S(s)]
        across = across.transpose(-3, -2) * later  # [..., n(I), S, n(J), S]
        M = block_scores.unsqueeze(-2) * block_eye + across
        out.append(M.reshape(*lead, C, C))
    return out


def kda_chunked(q, k, v, g, beta, scale: float | None = None,
                initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                qk_l2norm: bool = False, chunk_size: int = CHUNK_SIZE):
    """The recurrence in chunks (WY/UT form): ``(o, final state or None)`` as :func:`kda_recurrent`.

    Within a chunk with cumulative log-decay G_t = g_1 + ... + g_t and entering state S0, the
    delta-rule corrections u_t (S_t = diag(e^G_t) S0 + sum_{s<=t} (k_s e^(G_t-G_s)) u_s^T) solve a
    unit lower-triangular system (I + diag(beta) A) u = beta v - beta (k e^G) S0, A[t, s] =
    k_t . (k_s e^(G_t - G_s)) for s < t; so u = U - W S0 with U, W from one triangular solve for all
    chunks at once. Only the chunk-to-chunk state update is sequential. Tail positions padded to a
    whole chunk have k = v = g = beta = 0 and change nothing."""
    _check(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"kda: chunk_size must be positive, got {chunk_size}")
    if bool((g > 0).any()):  # the chunked form relies on decays, exp(g) <= 1
        raise ValueError("kda: g is a log-decay and must be <= 0; it has positive entries")
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, g, beta = _prepared(q, k, v, g, beta, scale, qk_l2norm)
    dtype = q.dtype
    if T == 0:
        empty = v.new_zeros(B, 0, H, V).to(out_dtype)
        state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
        return empty, (state if output_final_state else None)
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x):  # [B, T, H, D] -> [B, H, N, C, D]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q_c, k_c, v_c, g_c = chunks(q), chunks(k), chunks(v), chunks(g)
    beta_c = chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]
    # Cumulative decay within each chunk, in float64: exponents below are its differences, which
    # float32 would only know to float32's precision of G (|G| reaches 320 at K3's bound).
    G = g_c.double().cumsum(dim=-2)
    G_last = G[..., -1:, :]  # [B, H, N, 1, K]

    A_kk, A_qk = _decayed_scores([k_c, q_c], k_c, G, [False, True])
    eye = torch.eye(C, dtype=dtype, device=q.device)
    # The inverse itself, then products: on CPU, LAPACK's batched solve is far slower with wide
    # right-hand sides than with the identity, and with several batch dimensions than with one.
    system = (eye + beta_c * A_kk).reshape(B * H * N, C, C)
    inverse = torch.linalg.solve_triangular(system, eye.repeat(B * H * N, 1, 1), upper=False,
                                            unitriangular=True).reshape(B, H, N, C, C)
    U = inverse @ (beta_c * v_c)
    decay_in = G.to(dtype).exp()  # from the chunk's start
    W = inverse @ (beta_c * k_c * decay_in)
    k_to_end = k_c * (G_last - G).to(dtype).exp()  # each key decayed to the end of its chunk
    decay_end = G_last.squeeze(-2).to(dtype).exp().unsqueeze(-1)  # [B, H, N, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    entering, corrections = [], []

    def per_chunk(x):  # chunk-major and contiguous (strided operands slow CPU matmuls down a
        # lot), unbound once (indexing chunk i in the loop would make autograd write a
        # whole-size gradient per chunk)
        return x.movedim(2, 0).contiguous().unbind(0)

    for U_i, W_i, kT_i, decay_i in zip(per_chunk(U), per_chunk(W),
                                       per_chunk(k_to_end.transpose(-1, -2)),
                                       per_chunk(decay_end)):
        entering.append(S)
        u = U_i - W_i @ S
        corrections.append(u)
        S = decay_i * S + kT_i @ u
    S_in = torch.stack(entering, dim=2)  # [B, H, N, K, V]
    u = torch.stack(corrections, dim=2)  # [B, H, N, C, V]
    o = (q_c * decay_in) @ S_in + A_qk @ u
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), (S if output_final_state else None)


@lru_cache(maxsize=None)
def _fla_chunk_kda():
    """fla-core's ``chunk_kda``, or None where fla (and so triton) is not installed."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def kda_backend(device: torch.device | str) -> str:
    """``"fla"`` or ``"chunked"`` for tensors on ``device``: the one place that decides.

    ``SLMOE_KERNELS`` as for the native ops: ``auto`` (default) takes fla-core's kernel on CUDA
    where it is installed, ``reference`` always the pure-torch chunked path, ``native`` insists on
    fla and raises where it cannot run."""
    choice = os.environ.get(KERNELS_ENV, "").strip() or "auto"
    if choice not in ("auto", "native", "reference"):
        raise ValueError(f"{KERNELS_ENV} must be one of auto, native, reference, got {choice!r}")
    if choice == "reference":
        return "chunked"
    usable = torch.device(device).type == "cuda" and _fla_chunk_kda() is not None
    if usable:
        return "fla"
    if choice == "native":
        raise RuntimeError(f"{KERNELS_ENV}=native but fla-core's chunk_kda cannot run on {device}: "
                           "it needs CUDA and the fla package (pip install fla-core)")
    return "chunked"


def kda(q, k, v, g, beta, scale: float | None = None, initial_state: torch.Tensor | None = None,
        output_final_state: bool = False, qk_l2norm: bool = False):
    """KDA on the backend :func:`kda_backend` chooses for q's device: ``(o, final state or None)``.

    fla's kernel gets the decay and beta as computed here (no gate or sigmoid inside the kernel,
    so its version-dependent gate flags never matter) and a float32 initial state."""
    _check(q, k, v, g, beta, initial_state)
    if kda_backend(q.device) == "fla":
        o, final = _fla_chunk_kda()(
            q, k, v, g.float(), beta, scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=qk_l2norm)
        return o.to(v.dtype), final
    if q.shape[1] == 1:  # one decode step: the recurrence is the cheap form
        return kda_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, qk_l2norm)
    return kda_chunked(q, k, v, g, beta, scale, initial_state, output_final_state, qk_l2norm)
