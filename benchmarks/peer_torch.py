"""The peer on the same GPU: transformers' Llama + torch.compile, fused AdamW, grad clipping.

    python3 benchmarks/peer_torch.py --model=llama-3.2-1b --batch_size=8 --seq_len=2048 [--eager]

Random init at a preset's shapes (jaxllmq's presets, so both sides train the same model), pure
bf16 weights, synthetic tokens. Prints one JSON line: tokens/s, step time, MFU (jaxllmq's:
ModelConfig.flops_per_token against the H100/H200 bf16 peak), peak memory, compile time, and the
loss every few steps.
"""

import argparse
import json
import statistics
import time

import torch
import transformers

from jaxllmq.model.architecture import preset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="no torch.compile (autocast over fp32)")
    args = p.parse_args()
    cfg = preset(args.model)
    d = cfg.to_hf_dict()
    hf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    hf.attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf).cuda()
    if not args.eager:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(
        0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device="cuda", generator=gen
    )

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=args.eager):
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if not args.eager:
        step = torch.compile(step)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    losses, times = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        losses.append(step())
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    for _ in range(5):
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    tps = args.batch_size * args.seq_len * args.steps / total
    print(
        json.dumps(
            {
                "peer": "transformers+"
                + ("eager-autocast" if args.eager else "torch.compile-bf16"),
                "model": args.model,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "tokens_per_s": tps,
                "step_ms_median": statistics.median(times),
                "mfu_spec": cfg.flops_per_token(args.seq_len) * tps / 989e12,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                "compile_s": compile_s,
                "losses": [float(x) for x in losses[:: max(1, args.steps // 10)]],
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
