"""Reference renderings of chat templates with `tools=` for composer-model's ChatTemplate.

Runs transformers' own `apply_chat_template(messages, tools=..., tokenize=False)` (the
renderer TRL's `environment_factory` uses) with the Qwen2.5 chat template, and writes

- crates/model/tests/fixtures/qwen2_5_tools.jinja: the template, byte for byte as TRL 1.16.0
  ships it in `trl/chat_templates/qwen2_5.jinja` (Qwen2.5's original chat template; a model
  artifact, used by the tests and by `recipes/repo_agent.toml` to give the tiny fixture
  checkpoint a tool-calling template);
- crates/model/tests/fixtures/qwen2_5_tools_reference.json: conversations, tools and the text
  transformers renders for them.

Tools are written with their keys sorted (composer reads JSON into sorted maps), so the
renderings compare byte for byte.

    /work/.venv-upstream/bin/python tools/ref_chat_tools.py
"""

import json
import os
import pathlib

import transformers
import trl
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/model/tests/fixtures"
FIXTURE_TOKENIZER = pathlib.Path(
    os.environ.get("COMPOSER_SHARED", ROOT.parent / "shared")
) / "fixtures/hf-tiny/qwen2-tiny"


def sorted_json(x):
    return json.loads(json.dumps(x, sort_keys=True))


def tool(name, description, properties, required):
    return sorted_json(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": properties,
                    "required": required,
                    "additionalProperties": False,
                },
            },
        }
    )


TOOLS = [
    tool(
        "read_file",
        "Read a text file, or the 1-based inclusive line range start_line..end_line.",
        {
            "path": {"type": "string", "description": "path relative to the repository root"},
            "start_line": {"type": "integer", "minimum": 1},
        },
        ["path"],
    ),
    tool("submit", "End the episode — grade it with \"hidden\" tests <here>.", {}, []),
]

CASES = [
    {
        "name": "prompt_with_tools",
        "messages": [{"role": "user", "content": "Implement `add` in pkg/mod.py."}],
        "tools": TOOLS,
        "add_generation_prompt": True,
    },
    {
        "name": "system_then_tool_results",
        "messages": [
            {"role": "system", "content": "You fix repositories."},
            {"role": "user", "content": "Task: naïve café ✓"},
            {"role": "assistant", "content": "<tool_call>\n{\"name\": \"submit\", \"arguments\": {}}\n</tool_call>"},
            {"role": "tool", "content": "first result\nline 2"},
            {"role": "tool", "content": "{\"error\": \"x\"}"},
        ],
        "tools": TOOLS,
        "add_generation_prompt": True,
    },
    {
        "name": "prefix_without_generation_prompt",
        "messages": [
            {"role": "user", "content": "Task"},
            {"role": "assistant", "content": "X"},
        ],
        "tools": TOOLS,
        "add_generation_prompt": False,
    },
    {
        "name": "no_tools",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": None,
        "add_generation_prompt": True,
    },
]


def main():
    template = (pathlib.Path(trl.__file__).parent / "chat_templates/qwen2_5.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(FIXTURE_TOKENIZER)
    cases = []
    for c in CASES:
        text = tok.apply_chat_template(
            c["messages"],
            tools=c["tools"],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=c["add_generation_prompt"],
        )
        cases.append({**c, "rendered": text})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "qwen2_5_tools.jinja").write_text(template)
    (OUT / "qwen2_5_tools_reference.json").write_text(
        json.dumps(
            {
                "generator": "tools/ref_chat_tools.py",
                "transformers": transformers.__version__,
                "trl": trl.__version__,
                "cases": cases,
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
