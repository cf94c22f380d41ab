"""Attention entropy, attention saturation and residual-stream norms of trained models.

  python bench/model_health.py artifacts/base artifacts/pretrain/model artifacts/sft/model [--data data/eval.jsonl]

Per model, on the first 64 eval rows (prompt + ` label` + EOS): the mean attention entropy per
layer (nats; uniform over n keys is log n), the share of attention rows whose largest weight is
above 0.999 (saturated: the softmax passes ~no gradient to the other keys), and the mean norm of
the residual stream before the final norm.  docs/benchmarks.md reports these before/after.
"""
from __future__ import annotations

import argparse
import json

import torch


@torch.no_grad()
def health(path: str, rows: list[dict]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    seqs = [tok(r["prompt"] + " " + r["label"]).input_ids + [tok.eos_token_id] for r in rows[:64]]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    valid = mask.bool()
    entropy, saturated = [], []
    for a in out.attentions:  # (B, H, T, T)
        p = a.clamp_min(1e-12)
        ent = -(p * p.log()).sum(-1)  # (B, H, T)
        rows_mask = valid.unsqueeze(1).expand_as(ent)
        entropy.append(round(float(ent[rows_mask].mean()), 3))
        saturated.append(round(float((a.amax(-1) > 0.999)[rows_mask].float().mean()), 3))
    norm = out.hidden_states[-2].norm(dim=-1)[valid].mean()
    return {"model": path, "arch": model.config.model_type, "attn_entropy": entropy, "attn_saturated": saturated,
            "resid_norm": round(float(norm), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--data", default="data/eval.jsonl")
    args = ap.parse_args()
    rows = [json.loads(x) for x in open(args.data)]
    for path in args.models:
        print(json.dumps(health(path, rows)))


if __name__ == "__main__":
    main()
