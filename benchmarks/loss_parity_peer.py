"""The peer's side of benchmarks/loss_parity.py: transformers' Llama trains from the exported
weights with fused AdamW, grad clipping and (on GPU) torch.compile, as benchmarks/peer_torch.py.

What stays different from jaxllmq's step, with the same weights, data and optimizer settings:
- logits: transformers' LM head writes them in the weights' dtype (bf16) and upcasts for the loss;
  jaxllmq's fused LM-head loss keeps them fp32 (bf16 rounding of each logit, ~2^-9 relative).
- RoPE: transformers rounds cos/sin to bf16 and rotates in bf16; jaxllmq rotates in fp32.
- gradients: both backpropagate in bf16; torch starts from the mean loss and keeps bf16 .grad
  through the clip, jaxllmq starts from the summed loss and divides by the token count in fp32.
- clipping: torch's norm comes from bf16 per-tensor norms and is rounded to bf16 (the grad-norm
  column shows its steps), its scale is 1/(norm + 1e-6), and the clipped grads are rounded to bf16
  again; jaxllmq's norm and scale are fp32. Adam's normalization makes the update all but blind to
  a grad's overall scale, so this moves the losses little.
- AdamW matches: fp32 arithmetic on bf16 moments and parameters, the moments and parameters
  rounded once when stored, decoupled decay p * lr * wd on the same tensors, bias correction
  from the same step count, eps outside the square root.
- kernels: sdpa/inductor vs cuDNN/XLA fusions reassociate sums differently.
With --dtype=float32 only the last remains: on CPU the first step's losses are identical and ten
steps agree to ~1e-5 (tests/test_loss_parity.py).
"""

import numpy as np
import torch
import transformers


def lr_at(step: int, lr: float, warmup: int) -> float:
    """jaxllmq's wsd schedule without a cooldown: lr * t / warmup (0 at t = 0), then lr."""
    return lr * step / warmup if step < warmup else lr


def run_peer(
    hf_dir: str,
    batches: np.ndarray,
    decayed: list[str],
    *,
    lr: float = 3e-4,
    warmup: int = 5,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    compile_: bool | None = None,
) -> dict:
    """Train the HF model in `hf_dir` one step per batch [steps, rows, T + 1]; decay `decayed`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compile_ = device == "cuda" if compile_ is None else compile_
    torch.manual_seed(0)
    # The weights' own dtype (config.json's torch_dtype), as peer_torch.py's pure-bf16 model.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype="auto", attn_implementation="sdpa"
    ).to(device)
    model.train()
    named = dict(model.named_parameters())  # a tied head appears once, as the embedding
    unknown = sorted(set(decayed) - set(named))
    if unknown:
        raise ValueError(f"decayed tensors the transformers model lacks: {unknown[:5]}")
    groups = [
        {"params": [p for n, p in named.items() if n in decayed], "weight_decay": weight_decay},
        {"params": [p for n, p in named.items() if n not in decayed], "weight_decay": 0.0},
    ]
    # A tensor lr: changing it between steps does not recompile the compiled step.
    lr_t = torch.tensor(0.0, device=device) if compile_ else 0.0
    opt = torch.optim.AdamW(groups, lr=lr_t, betas=(0.9, 0.95), eps=1e-8, fused=True)
    params = list(model.parameters())

    def step(inputs, targets):
        # shift_labels: the targets as given (jaxllmq's), every position trained on, mean over
        # all tokens; labels= alone would shift and drop the last position.
        loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0 else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), norm

    if compile_:
        step = torch.compile(step)
    losses, norms = [], []
    for i, tokens in enumerate(batches):
        for g in opt.param_groups:
            if compile_:
                g["lr"].fill_(lr_at(i, lr, warmup))
            else:
                g["lr"] = lr_at(i, lr, warmup)
        t = torch.from_numpy(tokens.astype(np.int64)).to(device)
        loss, norm = step(t[:, :-1].contiguous(), t[:, 1:].contiguous())
        losses.append(loss)
        norms.append(norm)
    return {
        "losses": [float(x) for x in losses],
        "grad_norms": [float(x) if x is not None else None for x in norms],
        "peer": "transformers+" + ("torch.compile" if compile_ else "eager"),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
