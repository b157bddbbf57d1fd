"""llmq's recompute switches as jax.checkpoint policies over named points in a decoder layer.

Each switch drops its named activations from what the backward pass keeps, so they are
recomputed from the layer's input instead: less memory, more FLOPs. llmq's implications hold:
block => att + ffn + norm; att => qkv; ffn => swiglu. `block` keeps only each layer's input.

`offload_residual` (llmq's --offload_residual) moves the residual stream after attention (RESID)
to pinned host memory for the backward pass instead of keeping it on the device (or, under
`block`, instead of recomputing it): jax.checkpoint_policies.save_and_offload_only_these_names.
"""

import dataclasses
from collections.abc import Callable

import jax

from jaxllmq.setting import Settings, setting

# Names used with jax.ad_checkpoint.checkpoint_name in model/llama.py's decoder_layer.
NORM, QKV, ATT, RESID, FFN, SWIGLU = "norm", "qkv", "att", "resid", "ffn", "swiglu"
# What a layer keeps for its backward pass unless told to recompute it. Everything unnamed
# (elementwise intermediates, attention's internals) is recomputed once any switch is on.
SAVED = (NORM, QKV, ATT, RESID, FFN, SWIGLU)


@dataclasses.dataclass(frozen=True)
class Recompute(Settings):
    """Which activations the backward pass recomputes instead of storing."""

    swiglu: bool = setting(
        False,
        "Recompute the SwiGLU product in backward instead of storing it (scanned layers always "
        "do).",
        flag="recompute_swiglu",
    )
    norm: bool = setting(
        False,
        "Recompute the RMSNorm outputs in backward (scanned layers always do).",
        flag="recompute_norm",
    )
    ffn: bool = setting(
        False,
        "Recompute the MLP's gate/up projections (implies --recompute_swiglu).",
        flag="recompute_ffn",
    )
    qkv: bool = setting(False, "Recompute the q/k/v projections in backward.", flag="recompute_qkv")
    att: bool = setting(
        False, "Recompute the attention output (implies --recompute_qkv).", flag="recompute_att"
    )
    block: bool = setting(
        False,
        "Recompute whole layers, keeping only their inputs (implies att, ffn, norm).",
        flag="recompute_block",
    )
    offload_residual: bool = setting(
        False, "Offload the residual stream kept for the backward pass to host memory."
    )

    def check(self) -> None:
        # llmq's implications, resolved once so the flags read as llmq users expect.
        set_ = lambda name: object.__setattr__(self, name, True)
        if self.block:
            set_("att"), set_("ffn"), set_("norm")
        if self.att:
            set_("qkv")
        if self.ffn:
            set_("swiglu")

    def names(self) -> tuple[str, ...]:
        """The checkpoint names not saved for the backward pass."""
        chosen = {NORM: self.norm, QKV: self.qkv, ATT: self.att, FFN: self.ffn, SWIGLU: self.swiglu}
        return tuple(name for name, on in chosen.items() if on)

    def for_layers(self, scanned: bool) -> "Recompute":
        """These switches as layers run them: scanned, with the SwiGLU product and the RMSNorm
        outputs recomputed as well. A scan keeps its layers' activations for the backward pass
        in stacked buffers, a copy into them in the forward and out of them in the backward
        (its train step compiles without XLA's dynamic-slice fusions, xla_flags.step_options).
        Recomputing these two costs about what copying them does, and keeps 8-11 GiB less of
        the 1B's and Qwen3 1.7B's steps; Gemma 3 1B's ran 3.4% faster with them and kept 8.4
        GiB less (docs/PERFORMANCE.md)."""
        if scanned:
            return dataclasses.replace(self, swiglu=True, norm=True)
        return self

    def labels(self) -> list[str]:
        """What is recomputed, for a person or a record: the switches' names, and "block"."""
        return list(self.names()) + (["block"] if self.block else [])

    def saves_all(self) -> bool:
        """True when no policy applies: the backward pass keeps every activation."""
        return not (self.offload_residual or self.block or self.names())

    def wrap(self, layer: Callable, *, scanned: bool) -> Callable:
        """`layer` under jax.checkpoint with this policy (unchanged when nothing is
        recomputed: only unrolled layers, as scanned ones recompute some, for_layers)."""
        if self.offload_residual:
            kept = [] if self.block else [n for n in SAVED if n not in self.names() and n != RESID]
            policy = jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=kept,
                names_which_can_be_offloaded=[RESID],
                offload_src="device",
                offload_dst="pinned_host",
            )
        elif self.block:
            policy = jax.checkpoint_policies.nothing_saveable
        elif self.saves_all():
            return layer
        else:
            kept = [name for name in SAVED if name not in self.names()]
            policy = jax.checkpoint_policies.save_only_these_names(*kept)
        # Inside a scan, CSE cannot merge the recomputation into the forward: no barrier needed.
        return jax.checkpoint(layer, policy=policy, prevent_cse=not scanned)
