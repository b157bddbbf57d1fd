"""The Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 3) in Flax NNX.

Shape letters: B batch, T sequence, D model dim, N query heads, K kv heads, H head dim,
F ffn dim, V vocab, L layers.

Parameters keep Hugging Face names (q_proj, gate_proj, input_layernorm, ...) and carry logical
axis names in their `axes` metadata; the per-layer ones are stacked on a leading "layers" axis, so
the same storage serves scanned and unrolled layers, checkpoints and the HF name table alike.
Matrices are stored [in, out] (HF stores [out, in]; hf.py transposes).
"""

import functools
import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from jaxllmq.documents import DOCUMENTS_PER_WINDOW
from jaxllmq.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_tee
from jaxllmq.model import fp8, fp8_delayed, gemma
from jaxllmq.model.architecture import ModelConfig
from jaxllmq.model.attention import Documents, attend, documents_for, resolve_attention
from jaxllmq.model.custom_vjps import gated_activation, matmul_heads
from jaxllmq.model.kv_cache import KVCache
from jaxllmq.model.qkv_grads import can_fuse_qkv_grads, shared_input_matmuls
from jaxllmq.model.recompute import ATT, FFN, NORM, QKV, RESID, SWIGLU, Recompute
from jaxllmq.model.rotary import apply_rope, rope_cos_sin


def kinds_period(kinds: list) -> int:
    """The shortest p for which layer i is of layer i % p's kind, for every layer."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))


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

        one = 0.0 if cfg.is_gemma else 1.0  # Gemma's norms multiply by (1 + w)
        self.input_layernorm = vec(D, "norm", one)
        self.q_proj = mat((D, NH), ("embed", "q_heads"))
        self.k_proj = mat((D, KH), ("embed", "kv_heads"))
        self.v_proj = mat((D, KH), ("embed", "kv_heads"))
        self.o_proj = mat((NH, D), ("q_heads", "embed"), out_std)
        if cfg.attention_bias:
            self.q_bias = vec(NH, "q_heads", 0.0)
            self.k_bias = vec(KH, "kv_heads", 0.0)
            self.v_bias = vec(KH, "kv_heads", 0.0)
        if cfg.qk_norm:
            self.q_norm = vec(cfg.dim_per_head, "head_dim", one)
            self.k_norm = vec(cfg.dim_per_head, "head_dim", one)
        self.post_attention_layernorm = vec(D, "norm", one)
        if cfg.is_gemma:
            self.pre_feedforward_layernorm = vec(D, "norm", one)
            self.post_feedforward_layernorm = vec(D, "norm", one)
        self.gate_proj = mat((D, F), ("embed", "mlp"))
        self.up_proj = mat((D, F), ("embed", "mlp"))
        self.down_proj = mat((F, D), ("mlp", "embed"), out_std)

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


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
    window: int | None = None,
    attention_mesh: Mesh | None = None,
    deterministic_attention: bool = False,
) -> tuple[jax.Array, KVCache | None]:
    """One pre-norm block: x + attn(norm(x)), then + mlp(norm(.)) (Gemma's: each sublayer's
    output normed too, before the add). Params cast to `dtype` here. Returns the block's output
    and `cache` (one layer's, for decoding) with these tokens added. `window`, and
    `attention_mesh` as its `mesh` and `deterministic_attention` as its `deterministic`: attend's.

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
    fuse_residual_norm = fuse_residual_norm and not cfg.is_gemma

    def norm(x, name):  # Gemma's from the stored weight, in fp32: gemma.rms_norm
        if cfg.is_gemma:
            return gemma.rms_norm(x, p[name], eps)
        return rms_norm(x, w[name], eps, impl=norm_impl)

    if fuse_residual_norm:
        # The residual stream's gradient joins the norm's in its backward kernel (under pallas).
        h_BxTxD, x_BxTxD = rms_norm_tee(x_BxTxD, w["input_layernorm"], eps, impl=norm_impl)
    else:
        h_BxTxD = norm(x_BxTxD, "input_layernorm")
    h_BxTxD = checkpoint_name(h_BxTxD, NORM)
    if fuse_qkv_grads:
        q, k, v = shared_input_matmuls(h_BxTxD, (w["q_proj"], w["k_proj"], w["v_proj"]))
    else:
        q = linear(h_BxTxD, w["q_proj"], "q_proj")
        k = linear(h_BxTxD, w["k_proj"], "k_proj")
        v = linear(h_BxTxD, w["v_proj"], "v_proj")
    if cfg.attention_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    q_BxTxNxH, k_BxTxKxH = q.reshape(B, T, N, H), k.reshape(B, T, K, H)
    if cfg.qk_norm:  # each head's q and k RMS-normalized, before RoPE (Qwen3, Gemma 3)
        # A policy keeps the projections, which the norms' backward reads, and makes the normed
        # and rotated q and k again from them (unnamed, the backward ran the projections again).
        q_BxTxNxH = norm(checkpoint_name(q_BxTxNxH, QKV), "q_norm")
        k_BxTxKxH = norm(checkpoint_name(k_BxTxKxH, QKV), "k_norm")
    q_BxTxNxH = apply_rope(q_BxTxNxH, cos_BxTxH, sin_BxTxH)
    k_BxTxKxH = apply_rope(k_BxTxKxH, cos_BxTxH, sin_BxTxH)
    if not cfg.qk_norm:
        q_BxTxNxH, k_BxTxKxH = checkpoint_name(q_BxTxNxH, QKV), checkpoint_name(k_BxTxKxH, QKV)
    v_BxTxKxH = checkpoint_name(v.reshape(B, T, K, H), QKV)
    o_BxTxNxH, cache = attend(
        q_BxTxNxH,
        k_BxTxKxH,
        v_BxTxKxH,
        cache,
        implementation=attention,
        documents=documents,
        window=window,
        scale=cfg.query_pre_attn_scalar**-0.5 if cfg.is_gemma else None,
        mesh=attention_mesh,
        deterministic=deterministic_attention,
        checkpoint_as=ATT,
    )
    if linear is fp8.matmul:
        o_BxTxD = matmul_heads(o_BxTxNxH, w["o_proj"])
    else:
        o_BxTxD = linear(o_BxTxNxH.reshape(B, T, N * H), w["o_proj"], "o_proj")
    if cfg.is_gemma:
        # Gemma's sublayer outputs are normed before the add, and those norms' backward reads the
        # products: named, a policy keeps them (unnamed, it ran o_proj and down_proj again).
        o_BxTxD = checkpoint_name(o_BxTxD, ATT)
        x_BxTxD = checkpoint_name(x_BxTxD + norm(o_BxTxD, "post_attention_layernorm"), RESID)
        h_BxTxD = norm(x_BxTxD, "pre_feedforward_layernorm")
    elif fuse_residual_norm:
        # The residual add and the norm in one pass (one Pallas kernel under --kernels=pallas).
        h_BxTxD, x_BxTxD = add_rms_norm(
            x_BxTxD, o_BxTxD, w["post_attention_layernorm"], eps, impl=norm_impl
        )
        x_BxTxD = checkpoint_name(x_BxTxD, RESID)
    else:
        # Under a recompute policy the norm must read the residual by its name, which the policy
        # saves or offloads; a fused sum it cannot keep would be rebuilt through the o_proj GEMM.
        x_BxTxD = checkpoint_name(x_BxTxD + o_BxTxD, RESID)
        h_BxTxD = norm(x_BxTxD, "post_attention_layernorm")
    h_BxTxD = checkpoint_name(h_BxTxD, NORM)
    gate_BxTxF = checkpoint_name(linear(h_BxTxD, w["gate_proj"], "gate_proj"), FFN)
    up_BxTxF = checkpoint_name(linear(h_BxTxD, w["up_proj"], "up_proj"), FFN)
    act = gemma.gelu_tanh if cfg.is_gemma else jax.nn.silu
    swiglu_BxTxF = checkpoint_name(gated_activation(act, gate_BxTxF, up_BxTxF), SWIGLU)
    mlp_BxTxD = linear(swiglu_BxTxF, w["down_proj"], "down_proj")
    if cfg.is_gemma:
        mlp_BxTxD = norm(checkpoint_name(mlp_BxTxD, FFN), "post_feedforward_layernorm")
    return x_BxTxD + mlp_BxTxD, cache


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
        attention_mesh: Mesh | None = None,
        deterministic_attention: bool = False,
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
        # The mesh that jaxllmq's flash attention runs on per device (attend's `mesh`), or None.
        self.attention_mesh = attention_mesh
        # Attention gradients bit-identical from run to run (--deterministic; attend's).
        self.deterministic_attention = deterministic_attention
        self.norm_impl = norm_impl  # RMSNorm: "xla" or "pallas" (kernels.resolve_impl)
        self.recompute = (recompute or Recompute()).for_layers(scan_layers)
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
        self.norm = nnx.Param(
            jnp.full((D,), 0.0 if cfg.is_gemma else 1.0, param_dtype), axes=("norm",)
        )
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
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        ropes = {False: rope_cos_sin(cfg, positions_BxT)}
        if any(cfg.layer_local_rope()):
            ropes[True] = rope_cos_sin(cfg, positions_BxT, local=True)
        documents = None
        if segment_ids_BxT is not None:
            per_window = self.documents_per_window or DOCUMENTS_PER_WINDOW
            documents = documents_for(self.attention, segment_ids_BxT, per_window)
        x_BxTxD = self.constrain(self.embed(tokens_BxT))

        def layer(x, p, amax, cache, window, local):
            """One layer, its `window` and `local` (Gemma's local RoPE) its kind's."""
            cos, sin = ropes[local]
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
                window=window,
                attention_mesh=self.attention_mesh,
                deterministic_attention=self.deterministic_attention,
            )
            return self.constrain(x), cache

        kinds = list(zip(cfg.layer_windows(), cfg.layer_local_rope(), strict=True))
        stacked = self.layers.arrays()
        period = kinds_period(kinds)
        if self.scan_layers and period == 1:
            scanned = self.recompute.wrap(
                functools.partial(layer, window=kinds[0][0], local=kinds[0][1]), scanned=True
            )
            x_BxTxD, cache = jax.lax.scan(
                lambda x, pac: scanned(x, *pac), x_BxTxD, (stacked, fp8_amax, cache)
            )
        elif self.scan_layers:
            # Layers of several kinds (Gemma 3: five local, then one global) scan in groups of
            # their period, each layer of a group with its kind's static window, so that any
            # attention runs them; the layers past the last whole group run unrolled after it.
            groups = len(kinds) // period

            def group(x, pac_PxL):
                caches = []
                for j, (w, lo) in enumerate(kinds[:period]):
                    # The layer's slice of its group's arrays is taken inside its policy, which
                    # leaves it to the backward: outside, the scan would stack each as a copy.
                    def one(x, pac_PxL, j=j, w=w, lo=lo):
                        return layer(x, *jax.tree.map(operator.itemgetter(j), pac_PxL), w, lo)

                    x, layer_cache = self.recompute.wrap(one, scanned=True)(x, pac_PxL)
                    caches.append(layer_cache)
                return x, jax.tree.map(lambda *c: jnp.stack(c), *caches)

            whole = jax.tree.map(
                lambda a: a[: groups * period].reshape(groups, period, *a.shape[1:]),
                (stacked, fp8_amax, cache),
            )
            x_BxTxD, cache_GxP = jax.lax.scan(group, x_BxTxD, whole)
            layer_caches = [jax.tree.map(lambda c: c.reshape(-1, *c.shape[2:]), cache_GxP)]
            for i in range(groups * period, len(kinds)):
                p, amax, layer_cache = jax.tree.map(
                    operator.itemgetter(i), (stacked, fp8_amax, cache)
                )
                x_BxTxD, layer_cache = self.recompute.wrap(
                    functools.partial(layer, window=kinds[i][0], local=kinds[i][1]), scanned=False
                )(x_BxTxD, p, amax, layer_cache)
                layer_caches.append(jax.tree.map(lambda c: c[None], layer_cache))
            cache = jax.tree.map(lambda *c: jnp.concatenate(c), *layer_caches)
        else:
            wrap = functools.partial(self.recompute.wrap, scanned=False)
            # One split per stacked weight rather than an index per layer: the split's gradient
            # is one concatenate of the layers' gradients, where L indexes transpose into L pads
            # summed (on the 1B step's H200 profile, fusions at about 1 TB/s, about 4 ms).
            n = cfg.num_hidden_layers
            per_layer = {k: [p[0] for p in jnp.split(v, n)] for k, v in stacked.items()}
            layer_caches = []
            for i, (w, lo) in enumerate(kinds):
                amax, layer_cache = jax.tree.map(operator.itemgetter(i), (fp8_amax, cache))
                x_BxTxD, layer_cache = wrap(functools.partial(layer, window=w, local=lo))(
                    x_BxTxD, {k: v[i] for k, v in per_layer.items()}, amax, layer_cache
                )
                layer_caches.append(layer_cache)
            cache = jax.tree.map(lambda *c: jnp.stack(c), *layer_caches)  # None stays None
        if cfg.is_gemma:
            return gemma.rms_norm(x_BxTxD, self.norm[...], cfg.rms_norm_eps), cache
        h_BxTxD = rms_norm(
            x_BxTxD, self.norm[...].astype(self.dtype), cfg.rms_norm_eps, impl=self.norm_impl
        )
        return h_BxTxD, cache

    def embed(self, tokens_BxT: jax.Array) -> jax.Array:
        """The tokens' embeddings [B, T, D] in the compute dtype (Gemma's times sqrt(D)).

        The table's gradient is a scatter-add of the tokens' gradients. With the batch split over
        devices, each device scatters its own tokens and the dense [V, D] sums are reduced across
        devices: the last reduction of the backward pass, with no compute left to hide it. Below
        `gather_embed_below` tokens every device looks up the whole batch instead, so the
        backward all-gathers the tokens' gradients (B x T x D, fewer bytes) and each device
        scatter-adds all of them: the table's gradient needs no reduction.
        """
        table_VxD = self.embed_tokens[...]

        def lookup(tokens_BxT):  # Gemma's scaled in the table's dtype, as transformers does
            rows_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0)
            if self.cfg.is_gemma:
                rows_BxTxD = gemma.scale_embeddings(rows_BxTxD)
            return rows_BxTxD.astype(self.dtype)

        if tokens_BxT.size >= self.gather_embed_below:
            return lookup(tokens_BxT)
        return self.replicate(lookup(self.replicate(tokens_BxT)))

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
