#!/usr/bin/env python3
"""The table printed last by tools/gpu_check.sh: training tokens/s, peak GPU memory and MFU for
composer-rl next to PyTorch eager and torch.compile, and decode tokens/s against the HBM
roofline. Reads the `<tag>.json` / `<tag>.mem` files that gpu_check.sh wrote into DIR.

    python3 tools/gpu_summary.py DIR "GPU NAME, MEMORY, DRIVER"

MFU = tokens/s × FLOPs per token / peak dense bf16 (989 TFLOP/s, H100/H200 SXM datasheet).
FLOPs per token: 6·N (full training) or 4·N (LoRA: no weight gradients of the frozen base) for
the matrix products, N excluding an untied input embedding (a lookup), plus causal attention
6·L·H·d·T (half of the 12·L·H·d·T of full attention).
Decode roofline: every step reads the bf16 weights once plus each row's KV cache (average
context = prompt + half the new tokens), at the card's HBM bandwidth (H100 3.35, H200 4.8 TB/s).
"""
import json
import os
import sys

SHAPES = {  # vocab, hidden, layers, heads, kv_heads, head_dim, tied
    "qwen2.5-0.5b": (151936, 896, 24, 14, 2, 64, True),
    "qwen3-0.6b": (151936, 1024, 28, 16, 8, 128, True),
    "qwen2.5-7b": (152064, 3584, 28, 28, 4, 128, False),
}
PEAK_BF16 = 989e12


def load(d, tag):
    try:
        rep = json.load(open(os.path.join(d, tag + ".json")))
    except Exception:
        return None
    try:
        rep["peak_mem_mib"] = float(open(os.path.join(d, tag + ".mem")).read().strip())
    except Exception:
        rep["peak_mem_mib"] = None
    return rep


def flops_per_token(shape, n_params, seq, lora):
    v, h, layers, heads, _, hd, tied = SHAPES[shape]
    n_matmul = n_params if tied else n_params - v * h
    return (4 if lora else 6) * n_matmul + 6 * layers * heads * hd * seq


def train_cell(rep, shape, seq, lora):
    if not rep or not rep.get("rows") or rep["rows"][0].get("train_tokens_per_s") is None:
        return None
    tps = rep["rows"][0]["train_tokens_per_s"]
    mfu = tps * flops_per_token(shape, rep["num_parameters"], seq, lora) / PEAK_BF16
    return tps, rep["peak_mem_mib"], mfu


def fmt(cell, ran=True):
    """A training cell; `ran` = the benchmark left a JSON file (no file: not run in this call)."""
    if cell is None:
        return f"{'fail/OOM' if ran else 'not run':>27}"
    tps, mem, mfu = cell
    m = f"{mem / 1024:.1f} GiB" if mem else "-"
    return f"{tps:>9.0f} {m:>10} {100 * mfu:>5.1f}%"


def main():
    d, gpu = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    bw = 4.8e12 if "H200" in gpu else 3.35e12
    print("\ntraining (bf16, forward + next-token NLL + backward); cells: tokens/s, peak GPU memory, MFU")
    print(f"{'workload':<34} | {'composer-rl':>27} | {'torch eager':>27} | {'torch.compile':>27} | ratio eager  compile")
    rows = [
        ("qwen2.5-0.5b", 16, 512, False, "c05-t16", "te05-t16", "tc05-t16"),
        ("qwen2.5-0.5b", 64, 512, False, "c05-t64", "te05-t64", "tc05-t64"),
        # composer-rl padding-free: the varlen attention on tensor cores, then on the scalar
        # kernels (COMPOSER_ATTENTION_TC=0).
        ("qwen2.5-0.5b", 16, 512, False, "c05-t16pf", "te05-t16", "tc05-t16"),
        ("qwen2.5-0.5b", 16, 512, False, "c05-t16pf-scalar", "te05-t16", "tc05-t16"),
        # the padded batch attending through the varlen kernels (COMPOSER_PADDED_ATTENTION=varlen,
        # before 2026-11-27) or the masked softmax (=masked, since varlen is the default)
        ("qwen2.5-0.5b", 16, 512, False, "c05-t16-varlen", "te05-t16", "tc05-t16"),
        ("qwen2.5-0.5b", 16, 512, False, "c05-t16-masked", "te05-t16", "tc05-t16"),
        ("qwen3-0.6b", 1, 16384, False, "c06-t1", "te06-t1", None),
        # composer-rl padding-free (varlen flash-attention kernel), with and without checkpointing.
        ("qwen3-0.6b", 1, 16384, False, "c06-t1pf", "te06-t1", None),
        ("qwen3-0.6b", 1, 16384, False, "c06-t1pfn", "te06-t1", None),
        ("qwen3-0.6b", 1, 16384, False, "c06-t1pfn-scalar", "te06-t1", None),
        ("qwen2.5-7b", 8, 1024, True, "c7-t8", "te7-t8", None),
        # composer-rl with gradient_checkpointing (per-layer recompute); torch without.
        ("qwen2.5-0.5b", 64, 512, False, "c05-t64c", "te05-t64", None),
        ("qwen2.5-7b", 8, 1024, True, "c7-t8c", "te7-t8", None),
    ]
    for shape, b, seq, lora, ct, et, kt in rows:
        cr, er, kr = load(d, ct), load(d, et), load(d, kt) if kt else None
        c = train_cell(cr, shape, seq, lora)
        e = train_cell(er, shape, seq, lora)
        k = train_cell(kr, shape, seq, lora) if kt else None
        if cr is None:
            continue
        r_e = f"{c[0] / e[0]:>5.2f}" if c and e else "    -"
        r_k = f"{c[0] / k[0]:>7.2f}" if c and k else "      -"
        name = f"{shape} {b}x{seq}" + (" LoRA r16" if lora else "")
        name += {"pf": " packed+ckpt", "pfn": " packed"}.get(ct.rsplit("t1", 1)[-1].removesuffix("-scalar"), "") if ct.startswith("c06") else ""
        name += " packed" if ct.startswith("c05-t16pf") else ""
        name += " scalar attn" if ct.endswith("-scalar") else ""
        name += " varlen attn" if ct.endswith("-varlen") else ""
        name += " masked softmax" if ct.endswith("-masked") else ""
        print(f"{name:<34} | {fmt(c)} | {fmt(e, er is not None)} | {fmt(k, kr is not None) if kt else f'{chr(45):>27}'} | {r_e}  {r_k}")

    print("\ncomposer-rl training step phases (s, synchronised): decoder forward / LM head + log-probs / backward")
    for shape, b, seq, lora, ct, et, kt in rows:
        rep = load(d, ct)
        if rep and rep.get("rows") and rep["rows"][0].get("train_phase_s"):
            fwd, head, bwd = rep["rows"][0]["train_phase_s"]
            print(f"{shape} {b}x{seq}{' LoRA' if lora else ''}: {fwd:.3f} / {head:.3f} / {bwd:.3f}")

    print("\ndecode (bf16, prompt 128 unless said, 64 new tokens, tokens/s excluding prefill; % of the HBM roofline)")
    for shape, ct, et in [("qwen2.5-0.5b", "c05-d", "te05-d"), ("qwen2.5-0.5b", "c05-d-fine", None),
                          ("qwen2.5-0.5b", "c05-d-coarse", None), ("qwen2.5-0.5b", "c05-d-notc", None),
                          ("qwen2.5-0.5b", "c05-d-skinny", None), ("qwen2.5-0.5b", "c05-d-long", None),
                          ("qwen2.5-7b", "c7-d", None)]:
        c, e = load(d, ct), load(d, et) if et else None
        if not c:
            continue
        v, h, layers, heads, kvh, hd, tied = SHAPES[shape]
        wbytes = 2 * c["num_parameters"]
        ers = {r["batch"]: r for r in (e or {}).get("rows", [])}
        # HF generate with its static KV cache (te05-d-static), beside the default one.
        st = load(d, "te05-d-static") if et else None
        srs = {r["batch"]: r for r in (st or {}).get("rows", [])}
        for r in c["rows"]:
            b, tps = r["batch"], r["decode_tokens_per_s"]
            if tps is None:
                continue
            # Reports before 2026-11-28 carry no prompt_len / decode_tokens: 128 and 64.
            prompt, new = c.get("prompt_len", 128), c.get("decode_tokens", 64)
            kv = b * (prompt + new // 2) * layers * 2 * kvh * hd * 2
            roof = b / ((wbytes + kv) / bw)
            et_ = ers.get(b, {}).get("decode_tokens_per_s")
            tail = f" | HF generate {et_:>8.0f}  ratio {tps / et_:>5.1f}" if et_ else ""
            st_ = srs.get(b, {}).get("decode_tokens_per_s")
            tail += f" | HF static cache {st_:>8.0f}  ratio {tps / st_:>5.1f}" if st_ else ""
            g = r.get("decode_graphs_tokens_per_s")
            graphs = f" | CUDA graphs {g:>9.0f} ({100 * g / roof:>5.1f}%, {g / tps:>4.2f}x)" if g else ""
            # COMPOSER_DECODE_BLOCKS=1024 (fine) or 128 (coarse), COMPOSER_DECODE_TC=0 (notc),
            # COMPOSER_DECODE_GEMM=1 (skinny)
            label = shape + {"-fine": " fine", "-coarse": " coarse", "-notc": " no-tc",
                             "-skinny": " skinny", "-long": f" prompt {prompt}"}.get(ct[ct.rfind("-"):], "")
            print(f"{label:<19} batch {b:>4}: {tps:>9.0f} tok/s  roofline {roof:>9.0f}  ({100 * tps / roof:>5.1f}%){graphs}{tail}")

    rep = load(d, "c05-rollout-grpo")
    if rep and rep.get("arms"):
        lo, mean, p90, hi = rep["completion_len"]
        print(f"\nGRPO-shaped rollout, qwen2.5-0.5b bf16: 16 prompts x 8 samples, up to 256 new tokens "
              f"(lengths min {lo:.0f} mean {mean:.1f} p90 {p90:.0f} max {hi:.0f})")
        base = rep["arms"][0]["tokens_per_s"]
        for a in rep["arms"]:
            print(f"{a['arm']:<34} {a['seconds']:>7.2f} s {a['tokens_per_s']:>9.0f} tok/s "
                  f"({a['tokens_per_s'] / base:>4.2f}x)  decode steps {a['decode_forwards']:>5}  prefill {a['prefill_tokens']}")
        print(f"prefix sharing: {rep['arms'][0]['prefill_tokens']} prompt tokens prefilled instead of {rep['prefill_tokens_unshared']}")
    rep = load(d, "c05-rollout-det")
    if rep and rep.get("composer_rl"):
        r = rep["composer_rl"]
        eng, det = r["tokens_per_s"], r["deterministic_tokens_per_s"]
        print(f"\ndeterministic mode, qwen2.5-0.5b {r['dtype']} on {r['device']}: engine {eng:.0f} tok/s"
              f"{' (CUDA graphs)' if r.get('cuda_graphs') else ''}, deterministic {det:.0f} tok/s "
              f"({det / eng:.3f}x); max |sampler - scorer| over {r['deterministic_tokens']} tokens = "
              f"{r['deterministic_max_abs_diff']:g} (0 = bitwise)")
    rep = load(d, "c05-grpo-step")
    if rep and rep.get("composer_rl"):
        ours = rep["composer_rl"]["steps"]["median_step_s"]
        trl = rep.get("trl") or {}
        theirs = rep.get("trl_median_step_s")  # the same median as ours, computed by bench grpo
        ratio = f"{ours / theirs:.2f}" if theirs else "-"
        print(f"\nwhole GRPO step (P1), qwen2.5-0.5b bf16, 16 x 8 x 256: composer-rl {ours:.2f} s, "
              f"TRL {trl.get('trl', '-')} {theirs if theirs is None else round(theirs, 2)} s, ratio {ratio} (target <= 0.5)")


if __name__ == "__main__":
    try:
        main()
    except (KeyError, TypeError, ValueError, IndexError) as e:
        # A report of an unexpected form: say so; the raw reports are in results.jsonl.
        print(f"\ngpu_summary: stopped at a report it cannot read ({type(e).__name__}: {e}); see results.jsonl")
