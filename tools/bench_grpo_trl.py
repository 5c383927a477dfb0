"""TRL's side of `composer-rl bench grpo`: whole GRPO steps (generate, reward, train) of
TRL's own `GRPOTrainer` on the same checkpoint, prompts and shape as composer-rl's side.

The Rust CLI runs this file with `--python` and reads one JSON line from stdout: the wall time
of every optimizer step (a `TrainerCallback` from `on_step_begin` to `on_step_end`, which
includes TRL's generation inside the step), the mean completion length TRL logged, and the
versions. Generation is forced to `--new-tokens` (`min_new_tokens`) so TRL never does less
work than asked; composer-rl's side reports its own mean length beside it.

Needs torch, transformers, datasets and trl (1.16.0: `pip download trl==1.16.0 --no-deps`).
"""

import argparse
import json
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts-file", required=True, help="JSONL rows with a 'prompt' text")
    ap.add_argument("--prompts", type=int, required=True, help="prompts per step")
    ap.add_argument("--group", type=int, required=True, help="num_generations")
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--learning-rate", type=float, required=True)
    ap.add_argument("--loss-type", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32")
    a = ap.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    with open(a.prompts_file) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    def reward_parity(completions, **_):
        # Any cheap reward with spread: the advantages are non-zero, so the loss is real.
        return [float(len(c) % 2) for c in completions]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.step_s, self.mean_length, self.t0 = [], [], None

        def on_step_begin(self, args, state, control, **kw):
            if a.device != "cpu":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if a.device != "cpu":
                torch.cuda.synchronize()
            self.step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.mean_length.append(logs["completions/mean_length"])

    times = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=a.prompts * a.group,
            num_generations=a.group,
            max_completion_length=a.new_tokens,
            generation_kwargs={"min_new_tokens": a.new_tokens},
            temperature=1.0,
            loss_type=a.loss_type,
            beta=0.0,
            learning_rate=a.learning_rate,
            lr_scheduler_type="constant",
            max_steps=a.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=a.device == "cpu",
            bf16=a.dtype == "bf16",
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=reward_parity,
            args=config,
            train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
            processing_class=tokenizer,
            callbacks=[times],
        )
        trainer.train()
    print(
        json.dumps(
            {
                "step_s": times.step_s,
                "mean_completion_length": times.mean_length,
                "trl": trl.__version__,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
