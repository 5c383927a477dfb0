"""transformers' `generate` on the same prompt ids as `composer-rl bench rollout` (which runs this
script itself; it can also be run alone):

    python tools/bench_generate_hf.py --model DIR --prompt-ids 1,2,3 --batch 8 --new-tokens 128

KV cache on (`use_cache=True`), sampling at temperature 1 with no top-k/top-p, every sample
decoding exactly `--new-tokens` (min_new_tokens = max_new_tokens), float32 on the CPU with
`--threads` torch threads. One warm-up run, then `--repeats` timed runs. Prints one JSON line:
tokens/s of each run and their median, with the versions used.
"""
import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.eval()
    ids = [int(t) for t in args.prompt_ids.split(",") if t]
    input_ids = torch.tensor([ids] * args.batch, dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)
    runs = []
    for run in range(args.repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                use_cache=True,
                pad_token_id=model.config.eos_token_id
                if isinstance(model.config.eos_token_id, int) else 0,
            )
        secs = time.perf_counter() - start
        new = (out.shape[1] - input_ids.shape[1]) * args.batch
        if new != args.batch * args.new_tokens:
            raise SystemExit("decoded %d tokens, expected %d" % (new, args.batch * args.new_tokens))
        if run > 0:
            runs.append(new / secs)
    print(json.dumps({
        "runs_tokens_per_s": runs,
        "tokens_per_s": statistics.median(runs),
        "threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }))


main()
