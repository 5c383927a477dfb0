"""Reference AdamW steps from torch.optim.AdamW itself, for crates/train/tests/optim.rs.

    python tools/ref_adamw_torch.py > crates/train/tests/fixtures/adamw_torch.json

Runs torch's own (single-tensor, CPU, f32) AdamW on seeded parameters and gradients over six
steps with a changing learning rate, in two configurations: torch's defaults with weight decay,
and β1 = 0.3 (torch's lerp takes its other branch for weights >= 0.5) with a larger ε. Records
the torch version, the inputs and every step's parameters and final moments.
"""
import json
import random

import torch

CONFIGS = [
    {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    {"betas": [0.3, 0.95], "eps": 1e-3, "weight_decay": 0.1},
]
SHAPES = {"a": [5], "b": [3, 4]}
LRS = [1e-3, 5e-3, 2e-2, 2e-2, 1e-2, 1e-4]


def case(cfg, seed):
    rng = random.Random(seed)
    init = {k: [rng.uniform(-1, 1) for _ in range(torch.Size(s).numel())] for k, s in SHAPES.items()}
    # Gradients span magnitudes (tiny ones exercise ε, large ones the moments).
    grads = [
        {k: [rng.uniform(-1, 1) * 10 ** rng.uniform(-4, 1) for _ in range(len(v))] for k, v in init.items()}
        for _ in LRS
    ]
    params = {k: torch.tensor(v, dtype=torch.float32).reshape(SHAPES[k]).requires_grad_() for k, v in init.items()}
    names = sorted(params)
    opt = torch.optim.AdamW(
        [params[k] for k in names],
        lr=LRS[0],
        betas=tuple(cfg["betas"]),
        eps=cfg["eps"],
        weight_decay=cfg["weight_decay"],
        foreach=False,
        fused=False,
    )
    steps = []
    for lr, g in zip(LRS, grads):
        for group in opt.param_groups:
            group["lr"] = lr
        for k in names:
            params[k].grad = torch.tensor(g[k], dtype=torch.float32).reshape(SHAPES[k])
        opt.step()
        steps.append({k: params[k].detach().flatten().tolist() for k in names})
    state = {
        k: {
            "m": opt.state[params[k]]["exp_avg"].flatten().tolist(),
            "v": opt.state[params[k]]["exp_avg_sq"].flatten().tolist(),
        }
        for k in names
    }
    return {**cfg, "shapes": SHAPES, "lrs": LRS, "init": init, "grads": grads, "steps": steps, "state": state}


print(
    json.dumps(
        {"torch": torch.__version__, "optimizer": "torch.optim.AdamW(foreach=False, fused=False), CPU, float32",
         "cases": [case(c, 7 + i) for i, c in enumerate(CONFIGS)]},
        indent=1,
    )
)
