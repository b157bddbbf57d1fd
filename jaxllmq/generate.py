"""Sample text from an exported model or a checkpoint, with a KV cache and a jitted decode loop.

    python -m jaxllmq.generate --model=DIR | --checkpoint=DIR[/STEP] --prompt="def " \\
        [--max_new_tokens=64 --temperature=0.8 --top_p=0.95 --seed=0 --num_samples=1]

The prompt is prefilled in one forward pass that fills the cache (model/llama.py's KVCache), then
one token per step runs in a `jax.lax.while_loop` until --max_new_tokens or every sample has
written EOS. The cache has a static length (prompt + max_new_tokens), so the whole generation is
one compiled program. --temperature=0 is greedy decoding. The trainer's --sample_every_n_steps
uses `Sampler`.

Shape letters as in model/llama.py, plus P prompt length, M new tokens.
"""

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from jaxllmq.data import chat as chat_data
from jaxllmq.export import load_checkpoint, tokenizer_dir
from jaxllmq.model import hf
from jaxllmq.model.architecture import ModelConfig
from jaxllmq.model.llama import KVCache, abstract_model, params_of
from jaxllmq.setting import Settings, setting


class GenerateError(ValueError):
    """Input generation cannot use (a missing directory, no tokenizer, an empty prompt)."""


# ---- sampling ----


def sample_token(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_p: float):
    """Next tokens [B]: argmax at temperature 0, else nucleus (top-p) sampling."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV / temperature
    if top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (the most
        # likely one always): cut at the logit of the last token kept.
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_BxV, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        cutoff_B = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1)
        logits_BxV = jnp.where(logits_BxV >= cutoff_B[:, None], logits_BxV, -jnp.inf)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def make_decode(
    cfg: ModelConfig,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    dtype=jnp.float32,
) -> Callable[[dict, jax.Array, jax.Array, jax.Array], jax.Array]:
    """decode(params, prompt_BxP, n, key) -> new tokens [B, M]: continue the first n prompt tokens.

    Positions n..P-1 of the prompt are padding (one compiled program serves prompts up to P).
    After a row writes EOS it writes EOS again; the caller cuts there.
    """
    M = max_new_tokens
    eos = jnp.asarray(list(eos_ids) or [-1], jnp.int32)
    pad = int(eos_ids[0]) if eos_ids else 0
    graphdef, _, _ = abstract_model(cfg, dtype=dtype, attention="xla")

    def decode(params: dict, prompt_BxP: jax.Array, n: jax.Array, key: jax.Array) -> jax.Array:
        B, P = prompt_BxP.shape
        n = jnp.asarray(n, jnp.int32)
        model = nnx.merge(graphdef, params)
        logits_BxPxV, cache = model.cached_logits(prompt_BxP, KVCache.empty(cfg, B, P + M, dtype))
        logits_BxV = jax.lax.dynamic_index_in_dim(logits_BxPxV, n - 1, axis=1, keepdims=False)
        cache = cache.truncate(n)  # the padding's keys and values: overwritten by the new tokens

        def cond(carry):
            i, _, _, _, done_B = carry
            return (i < M) & ~jnp.all(done_B)

        def body(carry):
            i, cache, logits_BxV, out_BxM, done_B = carry
            tok_B = sample_token(logits_BxV, jax.random.fold_in(key, i), temperature, top_p)
            tok_B = jnp.where(done_B, pad, tok_B)
            out_BxM = jax.lax.dynamic_update_slice(out_BxM, tok_B[:, None], (0, i))
            done_B = done_B | jnp.isin(tok_B, eos)
            logits, cache = model.cached_logits(tok_B[:, None], cache)
            return i + 1, cache, logits[:, 0], out_BxM, done_B

        out_BxM = jnp.full((B, M), pad, jnp.int32)
        done_B = jnp.zeros((B,), bool)
        carry = (jnp.int32(0), cache, logits_BxV, out_BxM, done_B)
        return jax.lax.while_loop(cond, body, carry)[3]

    return decode


def cut_at_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The tokens before the first EOS."""
    out = []
    for t in tokens:
        if t in eos_ids:
            break
        out.append(int(t))
    return out


# ---- tokenizers ----


def load_tokenizer(
    directory: str | None, cfg: ModelConfig, chat: bool = False
) -> tuple[Tokenizer, tuple[int, ...]]:
    """The tokenizer.json in `directory` and the EOS ids: tokenizer_config.json's eos_token,
    else the model config's eos_token_id; with `chat`, also generation_config.json's
    eos_token_id (a chat template's end-of-turn tokens: <|eot_id|>, <end_of_turn>, ...)."""
    path = os.path.join(directory or "", "tokenizer.json")
    if not directory or not os.path.isfile(path):
        where = f"in {directory}" if directory else "for this model"
        raise GenerateError(f"no tokenizer.json {where}: generation needs the tokenizer")
    tok = Tokenizer.from_file(path)
    eos_token = None
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            eos_token = json.load(f).get("eos_token")
        if isinstance(eos_token, dict):  # older configs: {"content": "</s>", ...}
            eos_token = eos_token.get("content")
    eos_id = tok.token_to_id(eos_token) if isinstance(eos_token, str) else None
    ids = cfg.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    ids = [eos_id] if eos_id is not None else ids
    if chat:
        ids = list(dict.fromkeys([*ids, *chat_data.end_of_turn_ids(directory, tok)]))
    return tok, tuple(ids)


def encode_prompt(
    tok: Tokenizer, prompt: str, vocab_size: int, chat_dir: str | None = None
) -> list[int]:
    """The prompt's token ids (with the tokenizer's special tokens, e.g. Llama 3's BOS); with
    `chat_dir`, those of the prompt as a user message rendered by the chat template there,
    generation prompt included."""
    if not prompt:
        raise GenerateError("the prompt is empty")
    if chat_dir is None:
        ids = tok.encode(prompt).ids
    else:
        try:
            encoder = chat_data.ChatEncoder(chat_data.load_spec(chat_dir, tok), tok)
            ids = encoder.prompt_ids([{"role": "user", "content": prompt}])
        except (chat_data.ChatTemplateError, chat_data.Skip) as e:
            raise GenerateError(str(e)) from e
    if not ids:
        raise GenerateError(f"the prompt {prompt!r} encodes to no tokens")
    if max(ids) >= vocab_size:
        raise GenerateError(
            f"the tokenizer gives id {max(ids)} for {prompt!r}, beyond the model's vocab "
            f"({vocab_size}): tokenizer and model do not belong together"
        )
    return ids


class Sampler:
    """Greedy continuations of fixed prompts with given params (the trainer's `sample` records);
    with `chat`, replies to them as user messages.

    One compiled program serves all prompts: each is padded to the longest.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tokenizer_dir: str | None,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        dtype=jnp.float32,
        out_sharding: jax.sharding.Sharding | None = None,
        chat: bool = False,
    ):
        self.tok, self.eos_ids = load_tokenizer(tokenizer_dir, cfg, chat)
        self.prompts = list(prompts)
        chat_dir = tokenizer_dir if chat else None
        self.ids = [encode_prompt(self.tok, p, cfg.vocab_size, chat_dir) for p in self.prompts]
        self.width = max(map(len, self.ids))
        decode = make_decode(cfg, max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, dtype=dtype)
        self._decode = jax.jit(decode, out_shardings=out_sharding)

    def __call__(self, params: dict) -> list[tuple[str, str]]:
        """(prompt, continuation) for each prompt."""
        out = []
        key = jax.random.key(0)  # unused by greedy decoding
        for prompt, ids in zip(self.prompts, self.ids, strict=True):
            padded = np.zeros((1, self.width), np.int32)
            padded[0, : len(ids)] = ids
            new = np.asarray(self._decode(params, padded, np.int32(len(ids)), key))[0]
            out.append((prompt, self.tok.decode(cut_at_eos(new, self.eos_ids))))
        return out


# ---- the CLI ----


@dataclasses.dataclass(frozen=True)
class GenerateConfig(Settings):
    """Generation: which model, the prompt, and how to sample."""

    model: str | None = setting(None, "An HF model directory (e.g. exported).")
    checkpoint: str | None = setting(None, "A checkpoint DIR/STEP, or DIR (its newest).")
    prompt: str | None = setting(None, "The text to continue.")
    max_new_tokens: int = setting(64, "Tokens to generate.")
    temperature: float = setting(0.8, "Softmax temperature; 0 = greedy.")
    top_p: float = setting(0.95, "Nucleus sampling: keep this much mass.")
    seed: int = setting(0, "Sampling seed (same seed, same text).")
    num_samples: int = setting(1, "Continuations to sample.")
    chat: bool = setting(
        False,
        "Reply to --prompt as a user message: rendered with the tokenizer's chat template "
        "(generation prompt added); stops at the template's end-of-turn token.",
    )


def load(
    model: str | None = None, checkpoint_spec: str | None = None
) -> tuple[ModelConfig, dict, str | None]:
    """(model config, params, tokenizer directory) of an HF model dir or a checkpoint."""
    if (model is None) == (checkpoint_spec is None):
        raise GenerateError("give exactly one of --model and --checkpoint")
    if model is not None:
        if not os.path.isdir(model):
            raise GenerateError(f"--model={model}: no such directory")
        m = hf.from_pretrained(model)
        return m.cfg, params_of(m), model
    _, cfg, params, run = load_checkpoint(checkpoint_spec)
    params = jax.device_put(params, jax.devices()[0])  # read onto the CPU; decode on the GPU
    return cfg, params, tokenizer_dir(run["model"]["model"], run["data"]["train_files"])


def generate(
    cfg: ModelConfig,
    params: dict,
    tokenizer_dir: str | None,
    prompt: str,
    *,
    max_new_tokens: int = GenerateConfig.max_new_tokens,
    temperature: float = GenerateConfig.temperature,
    top_p: float = GenerateConfig.top_p,
    seed: int = GenerateConfig.seed,
    num_samples: int = GenerateConfig.num_samples,
    chat: bool = GenerateConfig.chat,
) -> list[str]:
    """num_samples continuations of `prompt` (the new text only), or with `chat` replies."""
    if max_new_tokens < 1 or num_samples < 1:
        raise GenerateError("--max_new_tokens and --num_samples must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise GenerateError("--temperature must be >= 0 and --top_p in (0, 1]")
    tok, eos_ids = load_tokenizer(tokenizer_dir, cfg, chat)
    ids = encode_prompt(tok, prompt, cfg.vocab_size, tokenizer_dir if chat else None)
    decode = make_decode(
        cfg,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_ids=eos_ids,
    )
    prompt_BxP = np.tile(np.asarray(ids, np.int32), (num_samples, 1))
    new = jax.jit(decode)(params, prompt_BxP, np.int32(len(ids)), jax.random.key(seed))
    return [tok.decode(cut_at_eos(row, eos_ids)) for row in np.asarray(new)]


if __name__ == "__main__":
    from jaxllmq.cli.generate import main

    main()
