#!/usr/bin/env python3
"""PyTorch eager side of `composer-rl bench model`: the same measurements with transformers.

Run by hand on a GPU machine (not by CI), next to the Rust benchmark, on the same card:

    python3 tools/bench_torch.py --device cuda --dtype bf16 --batch 1,16,64 --json

Model: transformers' Qwen2ForCausalLM / Qwen3ForCausalLM with the shape of `--shape`
(qwen2.5-0.5b, qwen3-0.6b, qwen2.5-7b), random weights (initializer_range 0.02) drawn on the
device in `--dtype`, attn_implementation="sdpa", eager mode unless `--compile` (then the
training step runs through `torch.compile(model)`; decoding is skipped). `--lora R`: PEFT
adapters of rank R, alpha 2R, on all linear layers (`target_modules="all-linear"`), base frozen.
Peak memory: `torch.cuda.max_memory_allocated()` after each row, and the device's used memory
(`torch.cuda.mem_get_info`, all of the card's, the CUDA context included) sampled every 10 ms
during each row's training steps — the method `composer-rl bench model` uses for its own side;
on the CPU the process's peak RSS. `--config-json` (an HF config.json's keys, what
`composer-rl bench model --torch` passes) builds any Qwen2/Qwen3/Llama shape instead of
`--shape`'s named ones.

- Training: tokens/s of forward + mean next-token NLL + backward, sequence length 512,
  parameters in `--dtype` (a bf16 step, like composer-rl's bench in bf16), 1 warm-up, median of
  `--train-iters` timed steps.
- Decoding: tokens/s excluding prefill = batch·(N−1) / (t(N tokens) − t(1 token)), sampling at
  temperature 1 with a KV cache (model.generate, min_new_tokens = max_new_tokens so no sample
  stops early), prompt length 128, N = 64 — the same definition as crates/model/src/bench.rs.
  `--static-cache`: generate with `cache_implementation="static"` (the KV cache preallocated
  to prompt + N, issue 17's "HF generate with sdpa and static cache"), still eager.
Timings synchronise the device before reading the clock.
"""
import argparse
import json
import resource
import statistics
import threading
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM


# Keys every shape shares (the Qwen2.5 / Qwen3 families), then each shape's own; the same
# shapes as composer-model's `ModelConfig::qwen2_5_0_5b` / `qwen3_0_6b` / `qwen2_5_7b`.
COMMON = dict(
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    initializer_range=0.02,
    bos_token_id=151643,
    eos_token_id=151643,
    pad_token_id=151643,
)
SHAPES = {
    "qwen2.5-0.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=True)),
    "qwen3-0.6b": (Qwen3Config, Qwen3ForCausalLM, dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=True)),
    "qwen2.5-7b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        tie_word_embeddings=False)),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class DeviceMemoryPeak:
    """The device's used memory (total - free), sampled every 10 ms while in the block (MiB)."""

    def __init__(self, device):
        self.device, self.peak, self.done = device, 0.0, threading.Event()

    def sample(self):
        free, total = torch.cuda.mem_get_info(self.device)
        self.peak = max(self.peak, (total - free) / 2**20)

    def __enter__(self):
        def loop():
            while not self.done.wait(0.01):
                self.sample()
        if self.device.type == "cuda":
            self.sample()
            self.thread = threading.Thread(target=loop, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.done.set()
            self.thread.join()
            self.sample()


def model_for(args):
    """(config, model class) of --config-json, else of --shape."""
    if args.config_json:
        from transformers import AutoConfig, AutoModelForCausalLM

        keys = json.loads(args.config_json)
        for k in ("architectures", "torch_dtype", "dtype", "transformers_version"):
            keys.pop(k, None)
        cfg = AutoConfig.for_model(keys.pop("model_type"), **keys)
        return cfg, AutoModelForCausalLM.from_config
    config_cls, model_cls, keys = SHAPES[args.shape]
    return config_cls(**COMMON, **keys), model_cls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16", "f16"])
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--train-seq-len", type=int, default=512)
    ap.add_argument("--train-iters", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--config-json", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--static-cache", action="store_true")
    ap.add_argument("--lora", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    cfg, model_cls = model_for(args)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(dtype)
    with device:
        model = model_cls(cfg)
    torch.set_default_dtype(torch.float32)
    num_parameters = sum(p.numel() for p in model.parameters())
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                       target_modules="all-linear"),
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    train_model = torch.compile(model) if args.compile else model
    if args.compile:
        args.skip_decode = True
    vocab = cfg.vocab_size
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        train_tps = None
        mem = DeviceMemoryPeak(device)
        if not args.skip_train:
            t = args.train_seq_len
            ids = (torch.arange(b * t, device=device) * 7919 + 13) % vocab
            ids = ids.view(b, t)
            model.train()

            def step():
                logits = train_model(input_ids=ids).logits[:, :-1]
                lp = torch.log_softmax(logits.float(), dim=-1)
                nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).mean()
                nll.backward()
                model.zero_grad(set_to_none=True)

            with mem:
                step()
                sync(device)
                times = []
                for _ in range(args.train_iters):
                    t0 = time.perf_counter()
                    step()
                    sync(device)
                    times.append(time.perf_counter() - t0)
            train_tps = b * t / statistics.median(times)
        peak_mb = torch.cuda.max_memory_allocated() / 1e6 if device.type == "cuda" else None
        peak_device_mib = mem.peak if device.type == "cuda" and not args.skip_train else None
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if args.skip_decode:
            rows.append({"batch": b, "train_tokens_per_s": train_tps, "decode_tokens_per_s": None,
                         "peak_gpu_mb": peak_mb, "peak_device_mib": peak_device_mib,
                         "peak_rss_mb": peak_rss_mb})
            continue
        model.eval()
        prompts = torch.tensor(
            [[(i * 31 + j * 17) % vocab for j in range(args.prompt_len)] for i in range(b)],
            device=device,
        )
        mask = torch.ones_like(prompts)

        def gen(n):
            with torch.no_grad():
                model.generate(
                    input_ids=prompts,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=cfg.pad_token_id,
                    **({"cache_implementation": "static"} if args.static_cache else {}),
                )

        gen(2)
        sync(device)
        t0 = time.perf_counter()
        gen(1)
        sync(device)
        t_one = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen(args.decode_tokens)
        sync(device)
        t_n = time.perf_counter() - t0
        decode_tps = b * (args.decode_tokens - 1) / max(t_n - t_one, 1e-9)
        rows.append({"batch": b, "train_tokens_per_s": train_tps, "decode_tokens_per_s": decode_tps,
                     "peak_gpu_mb": peak_mb, "peak_device_mib": peak_device_mib,
                     "peak_rss_mb": peak_rss_mb})
    mode = "torch.compile" if args.compile else "eager"
    report = {
        "framework": f"torch {torch.__version__} {mode}, sdpa" + (", static cache" if args.static_cache else "")
        + (f", peft LoRA r={args.lora}" if args.lora else ""),
        "shape": "config-json" if args.config_json else args.shape,
        "train_seq_len": args.train_seq_len,
        "num_parameters": num_parameters,
        "num_trainable_parameters": trainable,
        "device": str(device),
        "dtype": args.dtype,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"torch bench: {report['num_parameters']/1e6:.1f}M params on {device} ({args.dtype})")
        for r in rows:
            tr = "-" if r["train_tokens_per_s"] is None else f"{r['train_tokens_per_s']:.0f}"
            dec = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.0f}"
            print(f"{r['batch']:>6} {tr:>16} {dec:>16}")


if __name__ == "__main__":
    main()
