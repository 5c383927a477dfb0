#!/usr/bin/env python3
"""bf16 numerics reference: transformers in bf16 on CUDA vs its own f32 reference log-probs
(reference.json) for the hf-tiny fixtures, i.e. how far bf16 moves log-probs in PyTorch.
Compare with `composer-rl score --device cuda` (bf16) in tools/gpu_check.sh."""
import json, sys
import torch
from transformers import AutoModelForCausalLM

root = sys.argv[1]
for name in ["llama-tiny", "qwen2-tiny", "qwen3-tiny"]:
    ref = json.load(open(f"{root}/{name}/reference.json"))
    model = AutoModelForCausalLM.from_pretrained(f"{root}/{name}", dtype=torch.bfloat16).cuda().eval()
    worst, n = 0.0, 0
    for case in ref["cases"]:
        ids = torch.tensor([case["input_ids"]], device="cuda")
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        got = lp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist()
        worst = max([worst] + [abs(a - b) for a, b in zip(got, case["next_token_logprobs"])])
        n += len(got)
    print(f"bf16 on CUDA vs transformers f32: {name}: transformers bf16 max |d logprob| = {worst:.4f} over {n} tokens")
