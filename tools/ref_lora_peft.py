"""Reference logits of OUR LoRA adapter under upstream PEFT.

Loads the fixture base checkpoint with transformers (f32, eager attention), loads the adapter
that composer-model wrote (`adapter_config.json` + `adapter_model.safetensors`) with
`peft.PeftModel.from_pretrained`, and records the adapted logits, the logits after
`merge_and_unload()`, the base logits, and the package versions into `reference.json` next
to the adapter. Run through tools/ref_lora_peft.sh (which writes the adapter first).

    python tools/ref_lora_peft.py BASE_DIR ADAPTER_DIR
"""

import json
import sys

import peft
import torch
import transformers
from peft import PeftModel
from transformers import AutoModelForCausalLM

# Two rows of token ids inside the fixture's vocabulary (384).
INPUT_IDS = [[5, 17, 99, 3, 250, 42, 7, 300], [1, 2, 3, 4, 380, 200, 100, 50]]


def main() -> None:
    base_dir, adapter_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    ids = torch.tensor(INPUT_IDS)

    def load_base():
        return AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    with torch.no_grad():
        base_logits = load_base()(input_ids=ids).logits
        model = PeftModel.from_pretrained(load_base(), adapter_dir).eval()
        adapted_logits = model(input_ids=ids).logits
        merged_logits = model.merge_and_unload()(input_ids=ids).logits
    out = {
        "generator": "tools/ref_lora_peft.py",
        "peft_version": peft.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "input_ids": INPUT_IDS,
        "shape": list(adapted_logits.shape),
        "adapted_logits": adapted_logits.flatten().tolist(),
        "merged_logits": merged_logits.flatten().tolist(),
        "base_logits": base_logits.flatten().tolist(),
    }
    path = f"{adapter_dir}/reference.json"
    with open(path, "w") as f:
        json.dump(out, f)
    diff = (adapted_logits - base_logits).abs().max().item()
    print(f"wrote {path} (peft {peft.__version__}; max |adapted - base| = {diff:.3e})")


if __name__ == "__main__":
    main()
