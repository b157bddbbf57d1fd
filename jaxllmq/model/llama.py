"""The Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral) in Flax NNX.

Shape letters: B batch, T sequence, D model dim, N query heads, K kv heads, H head dim,
F ffn dim, V vocab, L layers.

Parameters keep Hugging Face names (q_proj, gate_proj, input_layernorm, ...) and carry logical
axis names in their `axes` metadata; the per-layer ones are stacked on a leading "layers" axis, so
the same storage serves scanned and unrolled layers, checkpoints and the HF name table alike.
Matrices are stored [in, out] (HF stores [out, in]; hf.py transposes).
"""

import dataclasses
import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxllmq.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_tee
from jaxllmq.model import fp8, fp8_delayed
from jaxllmq.model.architecture import ModelConfig, rope_inv_freq
from jaxllmq.model.attention import (
    Documents,
    attend_documents,
    default_documents_per_window,
    documents_for,
)
from jaxllmq.model.recompute import ATT, FFN, NORM, QKV, RESID, SWIGLU, Recompute

ATTENTION_IMPLS = ("auto", "xla", "cudnn")


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class DecoderLayers(nnx.Module):
    """All decoder layers' parameters, stacked on a leading [L] axis."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, init_proj_to_zero: bool, rngs: nnx.Rngs):
        L, D, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
        NH, KH = (
            cfg.num_attention_heads * cfg.dim_per_head,
            cfg.num_key_value_heads * cfg.dim_per_head,
        )
        std = 0.02
        # llmq's init: output projections scaled by 1/sqrt(2L) so the residual stream's variance
        # does not grow with depth; or zero, so every block starts as the identity.
        out_std = 0.0 if init_proj_to_zero else std / math.sqrt(2 * L)

        def mat(shape, axes, s=std):
            return nnx.Param(_normal(rngs, (L, *shape), s, param_dtype), axes=("layers", *axes))

        def vec(n, axes, fill):
            return nnx.Param(jnp.full((L, n), fill, param_dtype), axes=("layers", axes))

        self.input_layernorm = vec(D, "norm", 1.0)
        self.q_proj = mat((D, NH), ("embed", "q_heads"))
        self.k_proj = mat((D, KH), ("embed", "kv_heads"))
        self.v_proj = mat((D, KH), ("embed", "kv_heads"))
        self.o_proj = mat((NH, D), ("q_heads", "embed"), out_std)
        if cfg.attention_bias:
            self.q_bias = vec(NH, "q_heads", 0.0)
            self.k_bias = vec(KH, "kv_heads", 0.0)
            self.v_bias = vec(KH, "kv_heads", 0.0)
        if cfg.qk_norm:
            self.q_norm = vec(cfg.dim_per_head, "head_dim", 1.0)
            self.k_norm = vec(cfg.dim_per_head, "head_dim", 1.0)
        self.post_attention_layernorm = vec(D, "norm", 1.0)
        self.gate_proj = mat((D, F), ("embed", "mlp"))
        self.up_proj = mat((D, F), ("embed", "mlp"))
        self.down_proj = mat((F, D), ("mlp", "embed"), out_std)

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values of the tokens so far, for decoding a few tokens at a time.

    k, v [L, B, S, K, H] in the compute dtype, S the most tokens it holds; length [L] int32, the
    positions filled (the same in every layer), so the next tokens are at length, length + 1, ...
    Indexed or scanned over L like the stacked layers: one layer's has k, v [B, S, K, H] and a
    scalar length. Slots from length on are never read before tokens write them.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype) -> "KVCache":
        """A cache for `batch` sequences of up to `max_len` tokens, none yet."""
        L = cfg.num_hidden_layers
        zeros = jnp.zeros((L, batch, max_len, cfg.num_key_value_heads, cfg.dim_per_head), dtype)
        return cls(zeros, zeros, jnp.zeros((L,), jnp.int32))

    def truncate(self, length: jax.Array | int) -> "KVCache":
        """The cache of the first `length` tokens only (the next ones overwrite the rest)."""
        return dataclasses.replace(self, length=jnp.full_like(self.length, length))

    def append(self, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array) -> "KVCache":
        """One layer's cache with T more tokens' keys and values, written at `length`."""
        start = (0, self.length, 0, 0)
        return KVCache(
            jax.lax.dynamic_update_slice(self.k, k_BxTxKxH.astype(self.k.dtype), start),
            jax.lax.dynamic_update_slice(self.v, v_BxTxKxH.astype(self.v.dtype), start),
            self.length + k_BxTxKxH.shape[1],
        )


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [..., H] for the given integer positions, fp32 (HF's half-split layout)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BxTxNxH: jax.Array, cos_BxTxH: jax.Array, sin_BxTxH: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + H/2) by the position's angle; fp32 math, result in x's dtype."""
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BxTxH[:, :, None, :], sin_BxTxH[:, :, None, :]
    return (x * cos + rotated * sin).astype(x_BxTxNxH.dtype)


@jax.custom_vjp
def shared_input_matmuls(x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """(x @ w for w in ws), whose input gradient is one GEMM over the concatenated weights.

    Differentiated one by one, q, k and v each give x a gradient of their own (at K=512 for the
    1B's k and v, where cuBLAS runs at 440-540 TFLOP/s against 740), summed by separate adds.
    Here the backward concatenates the outputs' gradients (a copy XLA fuses into the RoPE
    backward that writes them) and the weights (a few MiB), and runs one GEMM with K the total
    width; the weights' gradients are one GEMM too, split by columns. The forward is unchanged:
    XLA already runs the three products as one GEMM.
    """
    return tuple(x @ w for w in ws)


def _shared_input_matmuls_fwd(x, ws):
    return shared_input_matmuls(x, ws), (x, ws)


def _shared_input_matmuls_bwd(res, cts):
    x, ws = res
    d_all = jnp.concatenate(cts, axis=-1)
    dx = d_all @ jnp.concatenate(ws, axis=1).T
    batch = tuple(range(x.ndim - 1))
    dw_all = jax.lax.dot_general(x, d_all, ((batch, batch), ((), ())))
    ends = [w.shape[1] for w in ws]
    splits = [sum(ends[: i + 1]) for i in range(len(ws) - 1)]
    return dx.astype(x.dtype), tuple(jnp.split(dw_all.astype(ws[0].dtype), splits, axis=1))


shared_input_matmuls.defvjp(_shared_input_matmuls_fwd, _shared_input_matmuls_bwd)


def resolve_attention(
    attention: str,
    dtype,
    *,
    platform: str | None = None,
    deterministic: bool = False,
) -> str:
    """'auto' -> cuDNN's fused attention on GPU (`platform`, default jax's backend) in bf16/fp16
    (packed documents too, as its segments), XLA's otherwise, and XLA's under XLA's
    deterministic ops (cuDNN's crashes under them)."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    if attention != "auto":
        return attention
    on_gpu = (platform or jax.default_backend()) in ("gpu", "cuda")
    fused = on_gpu and not deterministic and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return "cudnn" if fused else "xla"


def can_fuse_qkv_grads(linear_dtype: str | None) -> bool:
    """Whether q/k/v's input gradient can be one GEMM (shared_input_matmuls): with plain
    matmuls, not fp8 block linears."""
    return linear_dtype is None


def attend(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    cache: KVCache | None,
    *,
    implementation: str,
    documents: Documents | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Causal GQA attention (K kv heads serve N/K query heads each; cuDNN's fused kernel on GPU),
    and the cache, if any, holding these tokens' keys and values too.

    `documents` (attention.documents_for `implementation`): each query also reads only its own
    document's keys. With one layer's cache the queries are at positions cache.length.., and
    each reads the cached keys up to its own position."""
    if documents is not None:
        return attend_documents(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, documents), cache
    if cache is None:
        o_BxTxNxH = jax.nn.dot_product_attention(
            q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True, implementation=implementation
        )
        return o_BxTxNxH, None
    T, S = q_BxTxNxH.shape[1], cache.k.shape[1]
    visible_TxS = jnp.arange(S) <= (cache.length + jnp.arange(T))[:, None]
    cache = cache.append(k_BxTxKxH, v_BxTxKxH)
    o_BxTxNxH = jax.nn.dot_product_attention(
        q_BxTxNxH, cache.k, cache.v, mask=visible_TxS[None, None], implementation=implementation
    )
    return o_BxTxNxH, cache


def decoder_layer(
    p: dict[str, jax.Array],
    x_BxTxD: jax.Array,
    cos_BxTxH: jax.Array,
    sin_BxTxH: jax.Array,
    *,
    cfg: ModelConfig,
    dtype,
    attention: str,
    norm_impl: str,
    linear: Callable[[jax.Array, jax.Array, str], jax.Array] = fp8.matmul,
    fuse_residual_norm: bool = False,
    fuse_qkv_grads: bool = False,
    cache: KVCache | None = None,
    documents: Documents | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """One pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Params cast to `dtype` here.
    Returns the block's output and `cache` (one layer's, for decoding) with these tokens added.

    `linear(x, w, name)` is the q/k/v/o/gate/up/down matmul: `@` in `dtype`, or fp8
    (model/fp8.py, model/fp8_delayed.py, which needs the weight's name for its scales).
    `fuse_residual_norm`: the post-attention residual add inside its norm (add_rms_norm), and
    the residual's gradient inside the input norm's backward (rms_norm_tee); only without a
    recompute policy (Recompute.saves_all). `fuse_qkv_grads`: q, k and v through
    shared_input_matmuls (with `linear` the plain matmul, and no tensor parallelism, whose
    head split the concatenation would cross)."""
    B, T, _ = x_BxTxD.shape
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
    w = {k: v.astype(dtype) for k, v in p.items()}
    eps = cfg.rms_norm_eps

    if fuse_residual_norm:
        # The residual stream's gradient joins the norm's in its backward kernel (under pallas).
        h_BxTxD, x_BxTxD = rms_norm_tee(x_BxTxD, w["input_layernorm"], eps, impl=norm_impl)
    else:
        h_BxTxD = rms_norm(x_BxTxD, w["input_layernorm"], eps, impl=norm_impl)
    h_BxTxD = checkpoint_name(h_BxTxD, NORM)
    if fuse_qkv_grads:
        q, k, v = shared_input_matmuls(h_BxTxD, (w["q_proj"], w["k_proj"], w["v_proj"]))
    else:
        q = linear(h_BxTxD, w["q_proj"], "q_proj")
        k = linear(h_BxTxD, w["k_proj"], "k_proj")
        v = linear(h_BxTxD, w["v_proj"], "v_proj")
    if cfg.attention_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    if cfg.qk_norm:  # each head's q and k RMS-normalized, before RoPE (Qwen3)
        q = rms_norm(q.reshape(B, T, N, H), w["q_norm"], eps, impl=norm_impl)
        k = rms_norm(k.reshape(B, T, K, H), w["k_norm"], eps, impl=norm_impl)
    q_BxTxNxH = checkpoint_name(apply_rope(q.reshape(B, T, N, H), cos_BxTxH, sin_BxTxH), QKV)
    k_BxTxKxH = checkpoint_name(apply_rope(k.reshape(B, T, K, H), cos_BxTxH, sin_BxTxH), QKV)
    v_BxTxKxH = checkpoint_name(v.reshape(B, T, K, H), QKV)
    o_BxTxNxH, cache = attend(
        q_BxTxNxH,
        k_BxTxKxH,
        v_BxTxKxH,
        cache,
        implementation=attention,
        documents=documents,
    )
    o_BxTxNxH = checkpoint_name(o_BxTxNxH, ATT)
    o_BxTxD = linear(o_BxTxNxH.reshape(B, T, N * H), w["o_proj"], "o_proj")
    if fuse_residual_norm:
        # The residual add and the norm in one pass (one Pallas kernel under --kernels=pallas).
        h_BxTxD, x_BxTxD = add_rms_norm(
            x_BxTxD, o_BxTxD, w["post_attention_layernorm"], eps, impl=norm_impl
        )
        x_BxTxD = checkpoint_name(x_BxTxD, RESID)
    else:
        # Under a recompute policy the norm must read the residual by its name, which the policy
        # saves or offloads; a fused sum it cannot keep would be rebuilt through the o_proj GEMM.
        x_BxTxD = checkpoint_name(x_BxTxD + o_BxTxD, RESID)
        h_BxTxD = rms_norm(x_BxTxD, w["post_attention_layernorm"], eps, impl=norm_impl)
    h_BxTxD = checkpoint_name(h_BxTxD, NORM)
    gate_BxTxF = checkpoint_name(linear(h_BxTxD, w["gate_proj"], "gate_proj"), FFN)
    up_BxTxF = checkpoint_name(linear(h_BxTxD, w["up_proj"], "up_proj"), FFN)
    swiglu_BxTxF = checkpoint_name(jax.nn.silu(gate_BxTxF) * up_BxTxF, SWIGLU)
    return x_BxTxD + linear(swiglu_BxTxF, w["down_proj"], "down_proj"), cache


class Llama(nnx.Module):
    """Decoder-only LM. `__call__` gives final-normed hidden states; `logits` adds the head."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        scan_layers: bool = True,
        attention: str = "auto",
        norm_impl: str = "xla",
        recompute: Recompute | None = None,
        constrain: Callable[[jax.Array], jax.Array] | None = None,
        gather_layer: Callable[[dict], dict] | None = None,
        replicate: Callable[[jax.Array], jax.Array] | None = None,
        gather_embed_below: int = 0,
        init_proj_to_zero: bool = False,
        linear_dtype: str | None = None,
        gradient_dtype: str | None = None,
        fp8_quantizer: fp8.Quantizer | None = None,
        fuse_qkv_grads: bool = False,
        documents_per_window: int | None = None,
    ):
        self.cfg = cfg
        self.dtype = dtype
        # Block linears in fp8 ("e4m3"; gradients in gradient_dtype, default the same), or None:
        # in `dtype`. The LM head and attention stay in `dtype`, as llmq does.
        self.linear_dtype = linear_dtype
        self.gradient_dtype = gradient_dtype
        self.fp8_quantizer = fp8_quantizer or fp8.XLA_QUANTIZER  # x and g into both fp8 layouts
        # q/k/v's input gradient as one GEMM (shared_input_matmuls); not with fp8 linears, and
        # the caller's to ask for only without tensor parallelism.
        self.fuse_qkv_grads = fuse_qkv_grads and can_fuse_qkv_grads(linear_dtype)
        fp8.linear_fn(linear_dtype, gradient_dtype)  # unknown names fail here, not in a trace
        self.scan_layers = scan_layers
        self.attention = resolve_attention(attention, dtype)
        # Packed documents kept apart in a window (attention.documents_for), if segment ids come.
        self.documents_per_window = documents_per_window
        self.norm_impl = norm_impl  # RMSNorm: "xla" or "pallas" (kernels.resolve_impl)
        self.recompute = recompute or Recompute()
        # Sharding hooks (parallel/): `constrain` pins the activations' sharding at block
        # boundaries; `gather_layer` gives one layer's weights their compute sharding (under
        # ZeRO-3 that is the per-layer all-gather).
        self.constrain = constrain or (lambda x: x)
        self.gather_layer = gather_layer or (lambda p: p)
        # `replicate` gives an array the same value on every device. Below `gather_embed_below`
        # tokens per micro-batch the embedding lookup runs on every device's copy of the whole
        # batch (see embed).
        self.replicate = replicate or (lambda x: x)
        self.gather_embed_below = gather_embed_below
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nnx.Param(
            _normal(rngs, (V, D), 0.02, param_dtype), axes=("vocab", "embed")
        )
        self.layers = DecoderLayers(
            cfg, param_dtype=param_dtype, init_proj_to_zero=init_proj_to_zero, rngs=rngs
        )
        self.norm = nnx.Param(jnp.ones((D,), param_dtype), axes=("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                _normal(rngs, (D, V), 0.02, param_dtype), axes=("embed", "vocab")
            )

    def head_weight(self) -> jax.Array:
        """The LM head as [D, V] in the compute dtype (the embedding's transpose when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens[...].T.astype(self.dtype)
        return self.lm_head[...].astype(self.dtype)

    def __call__(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        fp8_amax: dict | None = None,
        segment_ids_BxT: jax.Array | None = None,
    ) -> jax.Array:
        """Final-normed hidden states [B, T, D] in the compute dtype.

        fp8_amax: with fp8 block linears, delayed scaling's reference amaxes (fp8_delayed's
        [L] tree; their gradient is this step's amaxes); None: current scaling.
        segment_ids_BxT: packed documents (data/pipeline.py's), each attending to itself only;
        their positions restart with each document (`positions_BxT`)."""
        return self._forward(tokens_BxT, positions_BxT, fp8_amax, None, segment_ids_BxT)[0]

    def _forward(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None,
        fp8_amax: dict | None,
        cache: KVCache | None,
        segment_ids_BxT: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """__call__'s hidden states, and the cache, if any, with these tokens added."""
        cfg = self.cfg
        B, T = tokens_BxT.shape
        if cfg.sliding_window is not None and T > cfg.sliding_window:
            raise ValueError(
                f"sequence length {T} exceeds the model's sliding_window {cfg.sliding_window}, "
                "which this trainer does not implement; use --seq_len <= sliding_window"
            )
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cos, sin = rope_cos_sin(cfg, positions_BxT)
        documents = None
        if segment_ids_BxT is not None:
            per_window = self.documents_per_window or default_documents_per_window(T)
            documents = documents_for(self.attention, segment_ids_BxT, per_window)
        x_BxTxD = self.constrain(self.embed(tokens_BxT))

        def layer(x, p, amax, cache):
            if amax is None:
                linear = fp8.linear_fn(self.linear_dtype, self.gradient_dtype, self.fp8_quantizer)
            else:
                linear = fp8_delayed.linear_fn(
                    self.linear_dtype, self.gradient_dtype, amax, self.fp8_quantizer
                )
            x, cache = decoder_layer(
                self.gather_layer(p),
                x,
                cos,
                sin,
                cfg=cfg,
                dtype=self.dtype,
                attention=self.attention,
                norm_impl=self.norm_impl,
                linear=linear,
                fuse_residual_norm=self.recompute.saves_all(),
                fuse_qkv_grads=self.fuse_qkv_grads,
                cache=cache,
                documents=documents,
            )
            return self.constrain(x), cache

        # Inside scan, CSE cannot merge the recomputation into the forward: no barrier needed.
        layer = self.recompute.wrap(layer, prevent_cse=not self.scan_layers)
        stacked = self.layers.arrays()
        if self.scan_layers:
            x_BxTxD, cache = jax.lax.scan(
                lambda x, pac: layer(x, *pac), x_BxTxD, (stacked, fp8_amax, cache)
            )
        else:
            # One split per stacked weight rather than an index per layer: the split's gradient
            # is one concatenate of the layers' gradients, where L indexes transpose into L pads
            # summed (on the 1B step's H200 profile, fusions at about 1 TB/s, about 4 ms).
            n = cfg.num_hidden_layers
            per_layer = {k: [p[0] for p in jnp.split(v, n)] for k, v in stacked.items()}
            layer_caches = []
            for i in range(n):
                amax, layer_cache = jax.tree.map(operator.itemgetter(i), (fp8_amax, cache))
                x_BxTxD, layer_cache = layer(
                    x_BxTxD, {k: v[i] for k, v in per_layer.items()}, amax, layer_cache
                )
                layer_caches.append(layer_cache)
            cache = jax.tree.map(lambda *c: jnp.stack(c), *layer_caches)  # None stays None
        h_BxTxD = rms_norm(
            x_BxTxD, self.norm[...].astype(self.dtype), cfg.rms_norm_eps, impl=self.norm_impl
        )
        return h_BxTxD, cache

    def embed(self, tokens_BxT: jax.Array) -> jax.Array:
        """The tokens' embeddings [B, T, D] in the compute dtype.

        The table's gradient is a scatter-add of the tokens' gradients. With the batch split over
        devices, each device scatters its own tokens and the dense [V, D] sums are reduced across
        devices: the last reduction of the backward pass, with no compute left to hide it. Below
        `gather_embed_below` tokens every device looks up the whole batch instead, so the
        backward all-gathers the tokens' gradients (B x T x D, fewer bytes) and each device
        scatter-adds all of them: the table's gradient needs no reduction.
        """
        table_VxD = self.embed_tokens[...]
        if tokens_BxT.size >= self.gather_embed_below:
            return jnp.take(table_VxD, tokens_BxT, axis=0).astype(self.dtype)
        tokens_BxT = self.replicate(tokens_BxT)
        return self.replicate(jnp.take(table_VxD, tokens_BxT, axis=0).astype(self.dtype))

    def logits(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, T, V] in fp32 (for evaluation and parity tests; training fuses)."""
        return self._head(self(tokens_BxT, positions_BxT, segment_ids_BxT=segment_ids_BxT))

    def cached_logits(self, tokens_BxT: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Logits [B, T, V] in fp32 of tokens that continue the cache's (at positions
        cache.length..), and the cache with them added: a prompt's prefill, or a decoding step."""
        B, T = tokens_BxT.shape
        positions_T = cache.length[0] + jnp.arange(T, dtype=jnp.int32)
        h_BxTxD, cache = self._forward(
            tokens_BxT, jnp.broadcast_to(positions_T, (B, T)), None, cache
        )
        return self._head(h_BxTxD), cache

    def _head(self, h_BxTxD: jax.Array) -> jax.Array:
        return jnp.einsum(
            "btd,dv->btv", h_BxTxD, self.head_weight(), preferred_element_type=jnp.float32
        )


def params_of(model: Llama) -> dict:
    """The model's parameters as a pure nested dict of arrays (the train state's layout)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def logical_axes(model: Llama) -> dict:
    """Each parameter's logical axis names, as a nested dict shaped like `params_of(model)`."""
    out: dict = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            *parents, leaf = path
            d = out
            for key in parents:
                d = d.setdefault(key, {})
            d[leaf] = node.get_metadata()["axes"]
    return out


def abstract_model(cfg: ModelConfig, **model_kwargs) -> tuple[nnx.GraphDef, dict, dict]:
    """(graphdef, params as ShapeDtypeStructs, logical axes) of a Llama, allocating nothing."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), **model_kwargs))
    graphdef, _ = nnx.split(abstract)
    return graphdef, params_of(abstract), logical_axes(abstract)
