"""GRPO in plain PyTorch on a model directory: how fast the verifiable reward fixes sft's slip.

The rl stage's maths without its machinery (no Ray, DeepSpeed or vLLM; HF `generate` for rollouts),
so learning rates and batch sizes can be compared in a minute each.  Per step: `--prompts` prompts
from DATA/rl.jsonl x 8 samples at T=1, exact-match reward, group-normalised advantages, one AdamW
step (no KL, clip 1.0) on the token-mean policy-gradient loss.  Prints the sampled reward on
addition and subtraction prompts and the greedy held-out accuracy on subtractions (where the slip
is) every 5 steps.

    python bench/lab_grpo.py artifacts/sft/model data --lr 1e-4 --steps 40 --prompts 64
"""
import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    rows = lambda f: [json.loads(x) for x in (Path(a.data) / f).read_text().splitlines()]  # noqa: E731
    rl, ev = rows("rl.jsonl"), rows("eval.jsonl")
    minus, plus = [r for r in ev if "-" in r["prompt"]], [r for r in ev if "-" not in r["prompt"]]

    def greedy_acc(subset) -> float:
        model.eval()
        ok = 0
        with torch.no_grad():
            for r in subset:
                ids = tok(r["prompt"], return_tensors="pt").input_ids
                out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
                ok += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == r["label"]
        return ok / len(subset)

    print(f"init: greedy accuracy on - {greedy_acc(minus):.3f}, on + {greedy_acc(plus):.3f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    for step in range(1, a.steps + 1):
        model.eval()
        groups, rewards = [], []
        with torch.no_grad():
            for r in random.sample(rl, a.prompts):
                ids = tok(r["prompt"], return_tensors="pt").input_ids
                out = model.generate(ids.repeat(a.samples, 1), max_new_tokens=4, do_sample=True, temperature=1.0, pad_token_id=tok.pad_token_id)
                reward = torch.tensor([float(tok.decode(o[ids.shape[1]:], skip_special_tokens=True).strip() == r["label"]) for o in out])
                rewards.append((reward.mean().item(), "-" in r["prompt"]))
                groups.append((out, (reward - reward.mean()) / (reward.std() + 1e-6), ids.shape[1]))
        model.train()
        opt.zero_grad()
        loss, n = 0.0, 0.0
        for out, adv, plen in groups:
            logp = torch.log_softmax(model(out).logits[:, :-1].float(), -1).gather(-1, out[:, 1:, None])[..., 0][:, plen - 1:]
            mask = (out[:, plen:] != tok.pad_token_id).float()
            loss = loss + (-(adv[:, None] * logp) * mask).sum()
            n += mask.sum()
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 5 == 0:
            mean = lambda minus_: sum(x for x, m in rewards if m == minus_) / max(1, sum(m == minus_ for _, m in rewards))  # noqa: E731
            print(f"step {step}: sampled reward + {mean(False):.3f}, - {mean(True):.3f}; greedy accuracy on - {greedy_acc(minus):.3f}", flush=True)
    print(f"final: greedy accuracy on - {greedy_acc(minus):.3f}, on + {greedy_acc(plus):.3f}")


if __name__ == "__main__":
    main()
