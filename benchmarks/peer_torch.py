"""The peer on the same GPU: transformers' Llama + torch.compile, fused AdamW, grad clipping.

    python3 -m benchmarks.peer_torch --model=llama-3.2-1b --batch_size=8 --seq_len=2048 [--eager]

Random init at a preset's shapes (jaxllmq's presets, so both sides train the same model), pure
bf16 weights, synthetic tokens. Prints one JSON line: tokens/s, step time, MFU (jaxllmq's:
ModelConfig.flops_per_token against the GPU's bf16 peak, jaxllmq/peaks.py), peak memory, compile
time, the loss every few steps, and the timed steps' energy and SM clock (as jaxllmq's bench gives
them: telemetry.EnergyMeter).
"""

import json
import statistics
import time

import torch
import transformers
from absl import app, flags

from jaxllmq.cli import flags as cli_flags
from jaxllmq.model.architecture import preset
from jaxllmq.peaks import peak_flops
from jaxllmq.telemetry import EnergyMeter, Nvml

flags.DEFINE_string("model", "llama-3.2-1b", "A jaxllmq preset.")
flags.DEFINE_integer("batch_size", 8, "Rows per step.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
flags.DEFINE_integer("steps", 20, "Timed steps.")
flags.DEFINE_integer("warmup", 3, "Untimed steps (torch.compile compiles in the first).")
flags.DEFINE_bool("eager", False, "No torch.compile (autocast over fp32).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    args = flags.FLAGS
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
    with EnergyMeter(Nvml(), [torch.cuda.current_device()]) as meter:
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
    peak = peak_flops(torch.cuda.get_device_name())
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
                "mfu_spec": cfg.flops_per_token(args.seq_len) * tps / peak if peak else None,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                "compile_s": compile_s,
                "losses": [float(x) for x in losses[:: max(1, args.steps // 10)]],
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
            | meter.fields(per=args.steps, unit="step")
        )
    )


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
