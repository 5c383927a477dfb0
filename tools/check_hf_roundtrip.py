#!/usr/bin/env python3
"""Loads a composer-rl checkpoint with transformers and compares its next-token log-probs with
`composer-rl score --json` computed on the same checkpoint (run by hand where transformers is
installed, e.g. the GPU machine):

    composer-rl score --model RUN/checkpoint --text "12+34=46" --json > score.json
    python3 tools/check_hf_roundtrip.py RUN/checkpoint score.json
"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ckpt, score_path = sys.argv[1], sys.argv[2]
ours = json.load(open(score_path))
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(ckpt)
ids = torch.tensor([ours["input_ids"]])
with torch.no_grad():
    lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
theirs = lp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist()
worst = max(abs(a - b) for a, b in zip(theirs, ours["next_token_logprobs"]))
print(f"transformers {type(model).__name__} loads {ckpt}: max |d logprob| vs composer-rl = {worst:.2e} "
      f"over {len(theirs)} tokens; tokenizer ids equal: {tok.encode('12+34=46', add_special_tokens=False) == ours['input_ids']}")
