"""Reference prompt ids for `messages` rows on a checkpoint with a non-ChatML chat template.

Copies the qwen2-tiny fixture checkpoint, gives the copy Qwen2.5's chat template
(crates/model/tests/fixtures/qwen2_5_tools.jinja, written by tools/ref_chat_tools.py) as its
`chat_template.jinja`, loads it with transformers' AutoTokenizer and writes the ids of
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` for a few
conversations to crates/train/tests/fixtures/qwen2_5_prompt_ids.json (the transformers
version in its header). Qwen2.5's template differs from ChatML: without a system message it
inserts its own default system prompt.

    /work/.venv-upstream/bin/python tools/ref_chat_template_ids.py
"""

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import transformers
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "crates/model/tests/fixtures/qwen2_5_tools.jinja"
OUT = ROOT / "crates/train/tests/fixtures/qwen2_5_prompt_ids.json"
FIXTURE = pathlib.Path(
    os.environ.get("COMPOSER_SHARED", ROOT.parent / "shared")
) / "fixtures/hf-tiny/qwen2-tiny"

CASES = [
    {"name": "user_only", "messages": [{"role": "user", "content": "What is 2+2?"}]},
    {
        "name": "system_and_user",
        "messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "3+4="},
        ],
    },
    {
        "name": "multi_turn_unicode",
        "messages": [
            {"role": "user", "content": "naïve café ✓"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again:\n  indented"},
        ],
    },
]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        model = pathlib.Path(tmp) / "qwen2-tiny-qwen25"
        shutil.copytree(FIXTURE, model)
        shutil.copy(TEMPLATE, model / "chat_template.jinja")
        tok = AutoTokenizer.from_pretrained(model)
        cases = []
        for c in CASES:
            ids = tok.apply_chat_template(
                c["messages"], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            cases.append({**c, "ids": [int(i) for i in ids]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "generator": "tools/ref_chat_template_ids.py",
                "transformers": transformers.__version__,
                "template": "crates/model/tests/fixtures/qwen2_5_tools.jinja",
                "template_sha256": hashlib.sha256(TEMPLATE.read_bytes()).hexdigest(),
                "cases": cases,
            },
            ensure_ascii=False,
        )
        + "\n"
    )
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
