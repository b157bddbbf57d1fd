"""GPU check: the 1B preset's bf16 forward with cuDNN attention matches XLA's attention.

    python benchmarks/attention_check.py [--model=llama-3.2-1b] [--seq_len=2048]

Prints the relative error ||a - b|| / ||b|| of the logits between the two bf16 forwards, and of
each against an fp32 XLA forward (the referee), plus each forward's time.
"""

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllmq.model.architecture import preset
from jaxllmq.model.llama import Llama, abstract_model, params_of


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    cfg = preset(args.model)
    params = jax.jit(lambda: params_of(Llama(cfg, rngs=nnx.Rngs(0))))()
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq_len), 0, cfg.vocab_size)
    outs, times = {}, {}
    for name, dtype, attention in [
        ("fp32-xla", jnp.float32, "xla"),
        ("bf16-xla", jnp.bfloat16, "xla"),
        ("bf16-cudnn", jnp.bfloat16, "cudnn"),
    ]:
        graphdef, _, _ = abstract_model(cfg, dtype=dtype, attention=attention)
        fwd = jax.jit(lambda p, t, g=graphdef: nnx.merge(g, p).logits(t))
        outs[name] = fwd(params, tokens).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(5):
            fwd(params, tokens).block_until_ready()
        times[name] = (time.perf_counter() - t0) / 5
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    print(f"{'forward':>12} {'ms':>8} {'rel err vs fp32':>16}")
    for name in outs:
        print(f"{name:>12} {1000 * times[name]:8.1f} {rel(outs[name], outs['fp32-xla']):16.2e}")
    # The referee is fp32: cuDNN's bf16 forward must be no further from it than XLA's bf16 one
    # (random-init logits are small, so bf16 rounding alone gives a few 1e-2 relative).
    cudnn, xla = rel(outs["bf16-cudnn"], outs["fp32-xla"]), rel(outs["bf16-xla"], outs["fp32-xla"])
    ok = cudnn <= 1.1 * xla
    print(
        f"cudnn vs xla (bf16): rel err {rel(outs['bf16-cudnn'], outs['bf16-xla']):.2e}; "
        f"vs fp32 {cudnn:.2e} against XLA's {xla:.2e} ({'OK' if ok else 'FAIL'})"
    )


if __name__ == "__main__":
    main()
