"""Loss parity with the peer: jaxllmq and transformers train the same initial weights
on the same batches with the same AdamW; their per-step losses are compared against a noise band.

    python -m benchmarks.loss_parity                        # GPU: llama-3.2-1b, 8 x 2048, 50 steps
    python -m benchmarks.loss_parity --model=tiny --batch_size=2 --seq_len=64 --steps=20  # CPU

Each side runs in its own process (--side=jax, then --side=peer; the default --side=both starts
them), so JAX's GPU memory preallocation and torch never share a device. The jax side builds the
preset through train_step.build (the trainer's and jaxllmq.bench's code path), exports its initial
weights with jaxllmq.model.hf.save_hf and lists the HF tensors its AdamW decays; the peer loads
that directory with transformers (sdpa attention, torch.compile on GPU as benchmarks/peer_torch.py)
and decays exactly those tensors. The data is a fixed sparse Markov chain (learnable, so the loss
falls), the same int32 arrays on both sides, every target trained on, mean over all tokens.

Noise band: a second jaxllmq run over the same batches in a shuffled order; the band is twice the
RMS of its per-step loss difference from the first run over the last 10 steps (the step-to-step
spread a user sees from the data order alone). The sides agree when both the last step's and the
last 10 steps' mean difference lie within it. Numerical differences between the sides that stay
(bf16): benchmarks/loss_parity_peer.py's docstring.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from absl import app, flags

from jaxllmq.cli import flags as cli_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # -m benchmarks.X runs here
LAST = 10  # the steps the verdict averages over


def markov_batches(
    vocab: int, steps: int, rows: int, seq_len: int, *, seed: int = 0, active: int = 2048
) -> np.ndarray:
    """int32 [steps, rows, seq_len + 1] from a sparse bigram chain: each of `active` random token
    ids has 4 random successors with probabilities (0.6, 0.25, 0.1, 0.05) (~1.1 nats/token). The
    chain is fixed (seed 0); `seed` draws the sequences."""
    chain = np.random.default_rng(0)
    ids = chain.choice(vocab, size=min(active, vocab), replace=False)
    succ = chain.integers(0, len(ids), size=(len(ids), 4))
    probs = np.array([0.6, 0.25, 0.1, 0.05])
    rng = np.random.default_rng(seed)
    # Drawn step by step, so a run's first batches do not depend on its length.
    draws = [
        (rng.integers(0, len(ids), rows), rng.choice(4, (rows, seq_len), p=probs))
        for _ in range(steps)
    ]
    state = np.empty((steps * rows, seq_len + 1), np.int64)
    state[:, 0] = np.concatenate([start for start, _ in draws])
    choice = np.concatenate([c for _, c in draws])
    for t in range(seq_len):
        state[:, t + 1] = succ[state[:, t], choice[:, t]]
    return ids[state].astype(np.int32).reshape(steps, rows, seq_len + 1)


def run_jax(
    model: str,
    batches: np.ndarray,
    *,
    hf_dir: str,
    dtype: str = "bfloat16",
    lr: float = 3e-4,
    warmup: int = 5,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    seed: int = 0,
    kernels: str = "auto",
    noise: bool = True,
    model_cfg=None,
) -> dict:
    """Train `model` (a preset; `model_cfg` overrides its shape) one step per batch on one device,
    after exporting the initial weights to `hf_dir`. Returns the per-step losses and grad norms,
    the HF names of the decayed tensors and, with `noise`, the losses of a shuffled-order run."""
    from jaxllmq import xla_flags

    xla_flags.apply_defaults()  # before jax starts its backend, as jaxllmq.bench does
    import jax

    from jaxllmq import train_step
    from jaxllmq.data.pipeline import to_global_arrays
    from jaxllmq.model import hf
    from jaxllmq.model.architecture import preset
    from jaxllmq.optim import decay_mask
    from jaxllmq.parallel.mesh import make_mesh
    from jaxllmq.plan import plan_for
    from jaxllmq.settings import ModelSpec, OptimConfig

    steps = len(batches)
    cfg = model_cfg or preset(model)
    spec = ModelSpec(
        model=model, from_scratch=True, model_dtype=dtype, matmul_dtype=dtype, kernels=kernels
    )
    # wsd without a cooldown: lr * t / warmup (0 at the first step), then constant; the peer
    # sets the same lr before each of its steps.
    optim = OptimConfig(
        lr=lr,
        warmup=warmup,
        lr_schedule="wsd",
        final_lr_fraction=1.0,
        beta_1=0.9,
        beta_2=0.95,
        adam_epsilon=1e-8,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        opt_m_dtype=dtype,  # torch keeps AdamW's moments in the parameters' dtype
        opt_v_dtype=dtype,
    )
    mesh = make_mesh(1)
    plan = plan_for(cfg, spec, mesh)
    built = train_step.build(cfg, spec, optim, plan, mesh=mesh, total_steps=steps, seed=seed)
    hf.save_hf(hf_dir, cfg, built.state.params)
    mask = decay_mask(built.axes, optim.decay_embeddings)
    decayed = [name for key, (name, _) in hf.TOP_NAMES.items() if mask.get(key)]
    decayed += [
        name.format(i=i)
        for key, (name, _) in hf.LAYER_NAMES.items()
        if mask["layers"].get(key)
        for i in range(cfg.num_hidden_layers)
    ]

    def batch(i: int) -> dict:
        tokens = batches[i][None]  # [acc=1, rows, T + 1]
        local = {
            "inputs": tokens[..., :-1],
            "targets": tokens[..., 1:],
            "loss_mask": np.ones(tokens[..., 1:].shape, bool),
        }
        return to_global_arrays(local, built.batch_sharding)

    # The step donates its state: keep a copy of the initial one for the shuffled run.
    initial = jax.tree.map(lambda x: x.copy(), built.state) if noise else None
    step = built.train_step.lower(built.state, batch(0)).compile()

    def run(state, order) -> tuple[list, list]:
        metrics = []
        for i in order:
            state, m = step(state, batch(i))
            metrics.append(m)
        metrics = jax.device_get(metrics)
        return [float(m["loss"]) for m in metrics], [float(m["norm"]) for m in metrics]

    losses, norms = run(built.state, range(steps))
    out = {"losses": losses, "grad_norms": norms, "decayed": decayed}
    out["jax_version"] = jax.__version__
    if noise:
        # The same batches in another order: a step's batch differs between the runs, so the
        # band holds the batch-to-batch spread of one step's loss and the order's effect.
        order = np.random.default_rng(seed + 1).permutation(steps)
        out["noise_losses"], _ = run(initial, order.tolist())
    return out


def compare(jax_losses: list, peer_losses: list, noise_losses: list | None) -> dict:
    """Differences (jax - peer) at the first and last step and over the last steps; the band."""
    a, b = np.asarray(jax_losses), np.asarray(peer_losses)
    d = a - b
    k = min(LAST, len(d))
    out = {
        "jax_loss_first": float(a[0]),
        "peer_loss_first": float(b[0]),
        "jax_loss_last": float(a[-1]),
        "peer_loss_last": float(b[-1]),
        "diff_first": float(d[0]),
        "diff_last": float(d[-1]),
        f"diff_last{k}_mean": float(d[-k:].mean()),
        f"diff_last{k}_max_abs": float(np.abs(d[-k:]).max()),
    }
    if noise_losses is not None:
        noise = np.asarray(noise_losses) - a
        band = 2.0 * float(np.sqrt(np.mean(noise[-k:] ** 2)))
        within = abs(d[-1]) <= band and abs(d[-k:].mean()) <= band
        out.update(noise_band=band, verdict="within noise" if within else "OUTSIDE noise")
    return out


def _report(args: flags.FlagValues, jax_out: dict, peer_out: dict) -> dict:
    """Print the per-step table and the verdict; return the JSON summary."""
    noise = jax_out.get("noise_losses")
    print(f"{'step':>5} {'jaxllmq':>9} {'peer':>9} {'diff':>9} {'norm jax':>9} {'norm peer':>9}")
    cols = ("losses", "grad_norms")
    rows = zip(*[out[c] for c in cols for out in (jax_out, peer_out)], strict=True)
    for i, (a, b, na, nb) in enumerate(rows):
        shuf = f" {noise[i]:9.4f} (shuffled)" if noise else ""
        nb = f"{nb:9.4f}" if nb is not None else f"{'-':>9}"
        print(f"{i + 1:5d} {a:9.4f} {b:9.4f} {a - b:+9.4f} {na:9.4f} {nb}{shuf}")
    summary = {
        "bench": "loss_parity",
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "dtype": args.dtype,
        "lr": args.lr,
        "warmup": args.warmup,
        **compare(jax_out["losses"], peer_out["losses"], noise),
        "jax_losses": [round(x, 5) for x in jax_out["losses"]],
        "peer_losses": [round(x, 5) for x in peer_out["losses"]],
        "shuffled_jax_losses": [round(x, 5) for x in noise] if noise else None,
        "peer": peer_out["peer"],
        "jax_version": jax_out["jax_version"],
        "torch_version": peer_out["torch_version"],
        "transformers_version": peer_out["transformers_version"],
    }
    k = min(LAST, args.steps)
    if "verdict" in summary:
        print(
            f"verdict: {summary['verdict']}: step {args.steps} diff {summary['diff_last']:+.4f}, "
            f"last-{k} mean diff {summary[f'diff_last{k}_mean']:+.4f}, band +-"
            f"{summary['noise_band']:.4f} (2 x RMS over the last {k} steps of a shuffled-order "
            f"jaxllmq run's difference); step-1 diff {summary['diff_first']:+.5f}"
        )
    print(json.dumps(summary))
    return summary


def _side_args(args: flags.FlagValues, side: str) -> list[str]:
    keys = ("model", "batch_size", "seq_len", "steps", "dtype", "lr", "warmup", "weight_decay")
    keys += ("grad_clip", "seed", "kernels", "peer_compile", "workdir")
    return [f"--side={side}"] + [f"--{k}={getattr(args, k)}" for k in keys]


def define_flags() -> None:
    flags.DEFINE_string("model", "llama-3.2-1b", "A jaxllmq preset.")
    flags.DEFINE_integer("batch_size", 8, "Rows per step.")
    flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
    flags.DEFINE_integer("steps", 50, "Steps compared.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Both sides' dtype.")
    flags.DEFINE_float("lr", 3e-4, "Peak learning rate.")
    flags.DEFINE_integer("warmup", 5, "Linear warmup from 0, then constant.")
    flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay.")
    flags.DEFINE_float("grad_clip", 1.0, "Global-norm clip.")
    flags.DEFINE_integer("seed", 0, "Init, data and shuffle seed.")
    flags.DEFINE_string("kernels", "auto", "jaxllmq's --kernels.")
    flags.DEFINE_enum("peer_compile", "auto", ["auto", "on", "off"], "torch.compile the peer.")
    flags.DEFINE_enum("side", "both", ["both", "jax", "peer"], "Which side this process runs.")
    flags.DEFINE_string("workdir", "", "Shared files; default a temporary directory.")
    flags.DEFINE_bool("no_noise", False, "Skip the shuffled-order jaxllmq run.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    args = flags.FLAGS
    if args.side == "jax":
        batches = np.load(os.path.join(args.workdir, "batches.npy"))
        out = run_jax(
            args.model,
            batches,
            hf_dir=os.path.join(args.workdir, "hf"),
            dtype=args.dtype,
            lr=args.lr,
            warmup=args.warmup,
            weight_decay=args.weight_decay,
            grad_clip=args.grad_clip,
            seed=args.seed,
            kernels=args.kernels,
            noise=not args.no_noise,
        )
        with open(os.path.join(args.workdir, "jax.json"), "w") as f:
            json.dump(out, f)
        return
    if args.side == "peer":
        from benchmarks.loss_parity_peer import run_peer

        batches = np.load(os.path.join(args.workdir, "batches.npy"))
        with open(os.path.join(args.workdir, "jax.json")) as f:
            decayed = json.load(f)["decayed"]
        compile_ = {"on": True, "off": False}.get(args.peer_compile)
        out = run_peer(
            os.path.join(args.workdir, "hf"),
            batches,
            decayed,
            lr=args.lr,
            warmup=args.warmup,
            weight_decay=args.weight_decay,
            grad_clip=args.grad_clip,
            compile_=compile_,
        )
        with open(os.path.join(args.workdir, "peer.json"), "w") as f:
            json.dump(out, f)
        return
    from jaxllmq.model.architecture import preset

    temp = not args.workdir
    if temp:
        args.workdir = tempfile.mkdtemp(prefix="loss_parity_")
    try:
        vocab = preset(args.model).vocab_size
        batches = markov_batches(vocab, args.steps, args.batch_size, args.seq_len, seed=args.seed)
        np.save(os.path.join(args.workdir, "batches.npy"), batches)
        for side in ("jax", "peer"):
            cmd = [sys.executable, "-m", "benchmarks.loss_parity", *_side_args(args, side)]
            cmd += ["--no_noise"] if args.no_noise else []
            subprocess.run(cmd, check=True, cwd=ROOT)
        with open(os.path.join(args.workdir, "jax.json")) as f:
            jax_out = json.load(f)
        with open(os.path.join(args.workdir, "peer.json")) as f:
            peer_out = json.load(f)
        summary = _report(args, jax_out, peer_out)
    finally:
        if temp:
            shutil.rmtree(args.workdir, ignore_errors=True)
    if summary.get("verdict", "").startswith("OUTSIDE"):
        sys.exit("FAIL: the sides' losses differ by more than the noise band")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli_flags.parse_argv)
