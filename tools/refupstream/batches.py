"""Random batches for tools/ref_upstream.py: one generator stream (`Gen`) shared by the
files that are not regenerated alone, and the JSON form of its arrays."""

import numpy as np
import torch

SEED = 20260601


def r6(x):
    """Round-trip floats exactly (json keeps 17 significant digits)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().tolist()
    if isinstance(x, np.ndarray):
        x = x.tolist()
    return x


# --------------------------------------------------------------------------------------------
# Random batches
# --------------------------------------------------------------------------------------------


class Gen:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def mask(self, b, t, holes=True, empty_rows=True, truncate=True):
        m = np.zeros((b, t))
        for i in range(b):
            r = self.rng.random()
            if empty_rows and r < 0.12:
                continue  # empty row
            n = t if (truncate and r > 0.8) else int(self.rng.integers(1, t + 1))
            m[i, :n] = 1.0
            if holes and self.rng.random() < 0.4 and n > 2:
                k = int(self.rng.integers(1, n))
                m[i, k] = 0.0  # a hole (tool output)
        return m

    def logprobs(self, b, t, scale=1.0):
        return -np.abs(self.rng.normal(0.0, scale, (b, t))) - 0.01

    def near(self, base, spread, extreme=False):
        d = self.rng.normal(0.0, spread, base.shape)
        if extreme:
            sel = self.rng.random(base.shape) < 0.15
            d = np.where(sel, self.rng.choice([-1.0, 1.0], base.shape) * self.rng.uniform(1.5, 4.0, base.shape), d)
        return np.minimum(base + d, -1e-3)

    def advantages(self, b, t=None, per_token=False):
        a = self.rng.normal(0.0, 1.0, b)
        a[self.rng.random(b) < 0.15] = 0.0
        if per_token:
            return a[:, None] + self.rng.normal(0.0, 0.5, (b, t))
        return a

    def entropies(self, b, t):
        # f32-representable: TRL takes the entropy quantile in float32.
        return np.abs(self.rng.normal(1.0, 0.6, (b, t))).astype(np.float32).astype(np.float64)


def batch(g, b, t, *, extreme=False, per_token_adv=False, sampler=True, ref=True, ent=True, old=True):
    lp = g.logprobs(b, t)
    x = {
        "trainer_logprobs": lp,
        "old_logprobs": g.near(lp, 0.15, extreme) if old else None,
        "advantages": g.advantages(b, t, per_token_adv),
        "loss_mask": g.mask(b, t),
    }
    base = x["old_logprobs"] if old else lp
    x["sampler_logprobs"] = g.near(base, 0.1, extreme) if sampler else None
    x["ref_logprobs"] = g.near(lp, 0.3, extreme) if ref else None
    x["entropies"] = g.entropies(b, t) if ent else None
    x["truncated"] = [bool(v) for v in (x["loss_mask"][:, -1] > 0)]
    return x


def jsonable_inputs(x):
    return {k: (r6(v) if v is not None else None) for k, v in x.items()}


class SingleProcess:
    """The accelerator a trainer built without __init__ reads: one process, CPU."""

    num_processes = 1
    process_index = 0
    sync_gradients = True
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def eff_mask(mb, mask_trunc):
    m = np.array(mb["loss_mask"])
    if mask_trunc:
        m = m * (~np.array(mb["truncated"]))[:, None]
    return m


def scale_of(mbs, mask_trunc):
    toks, seqs = 0.0, 0.0
    for mb in mbs:
        m = eff_mask(mb, mask_trunc)
        toks += m.sum()
        seqs += float((m.sum(1) > 0).sum())
    return {"global_active_tokens": toks, "global_sequences": seqs, "num_micro_batches": float(len(mbs))}
