"""Recipe lab for the learning chain (pretrain -> sft -> rm), plain PyTorch, one process.

Not the pipeline: a fast way to compare recipes (architecture, corpus formats, schedules) over
seeds before a recipe moves into the stages.  Runs on CPU or CUDA.  Prints one JSON line.

  python bench/lab_chain.py --seed 0 --pretrain-steps 600 --out /tmp/r.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlhf_core.data.task import TaskConfig, answer_text, draw_problem, generate_task, plausible_wrong  # noqa: E402
from rlhf_core.models.tiny import build_tokenizer  # noqa: E402


def corpus_docs(cfg: TaskConfig, rng: random.Random, n_problems: int, held: set[str], formats: list[str]) -> list[str]:
    docs, seen = [], set()
    stale = 0
    while len(seen) < n_problems and stale < 5000:  # 5000 draws in a row with nothing new: space exhausted
        expr, ans = draw_problem(rng, cfg)
        if expr in held or expr in seen:
            stale += 1
            continue
        stale = 0
        seen.add(expr)
        c = answer_text(cfg, ans)
        near = rng.random() < 0.5
        w = answer_text(cfg, plausible_wrong(rng, ans, cfg.allow_negative) if near else rng.randint(0, 2 * cfg.max_value))
        if w == c:
            w = answer_text(cfg, ans + 1)
        for f in formats:
            if f == "qa":
                docs.append(f"Q: {expr}= A: {c}")
            elif f == "eq":
                docs.append(f"{expr}={c}")
            elif f == "judge_nl":  # verdict on the next line (eval cuts at newline)
                x = c if rng.random() < 0.5 else w
                docs.append(f"Q: {expr}= A: {x}\n{'Right.' if x == c else 'Wrong, it is ' + c + '.'}")
            elif f == "judge_v":  # a verdict line the reward model reads ("\nVerdict:" suffix)
                x = c if rng.random() < 0.5 else w
                docs.append(f"Q: {expr}= A: {x}\nVerdict: {'right' if x == c else 'wrong'}")
            elif f == "judge_eq":
                x = c if rng.random() < 0.5 else w
                docs.append(f"{expr}={x} is {'right' if x == c else 'wrong'}")
            elif f == "both_nl":  # every problem: a right and a wrong claim
                docs.append(f"Q: {expr}= A: {c}\nRight.")
                docs.append(f"Q: {expr}= A: {w}\nWrong, it is {c}.")
    return docs


def build_model(tok, arch: str, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kw = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
              num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64, max_position_embeddings=256,
              tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**kw))
    return LlamaForCausalLM(LlamaConfig(**kw))


def lr_at(step, total, warmup, peak, min_ratio=0.1, sched="cosine"):
    if step < warmup:
        return peak * (step + 1) / warmup
    if sched == "constant":
        return peak
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def make_opt(model, lr, wd):
    ps = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
                              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def step_opt(model, opt, loss, lr, clip=1.0):
    for g in opt.param_groups:
        g["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def pad(seqs, pad_id, dev):
    w = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (w - len(s)) for s in seqs], device=dev)
    att = torch.tensor([[1] * len(s) + [0] * (w - len(s)) for s in seqs], device=dev)
    return ids, att


@torch.no_grad()
def greedy_acc(model, tok, rows, dev, max_new=6):
    model.eval()
    correct = 0
    for i in range(0, len(rows), 100):
        chunk = rows[i:i + 100]
        prompts = [tok(r["prompt"]).input_ids for r in chunk]
        w = max(len(p) for p in prompts)
        ids = torch.tensor([[tok.pad_token_id] * (w - len(p)) + p for p in prompts], device=dev)
        att = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in prompts], device=dev)
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for r, o in zip(chunk, out[:, w:].tolist()):
            text = tok.decode(o, skip_special_tokens=True).split("\n", 1)[0].strip()
            correct += text == r["label"]
    model.train()
    return correct / len(rows)


@torch.no_grad()
def diagnostics(model, tok, rows, dev):
    """Mean attention entropy (nats) per layer and final-layer residual norm, on eval prompts."""
    model.eval()
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    ids, att = pad([tok(r["prompt"] + " " + r["label"]).input_ids + [tok.eos_token_id] for r in rows[:64]], tok.pad_token_id, dev)
    out = model(input_ids=ids, attention_mask=att, output_attentions=True, output_hidden_states=True)
    ents = []
    for a in out.attentions:  # (B, H, T, T)
        e = -(a.clamp_min(1e-12) * a.clamp_min(1e-12).log()).sum(-1)  # (B, H, T)
        ents.append(round(float(e[att.bool().unsqueeze(1).expand_as(e)].mean()), 3))
    h = out.hidden_states[-2]  # before the final norm
    norm = float(h.norm(dim=-1)[att.bool()].mean())
    sat = float(sum((a.amax(-1) > 0.999).float().mean() for a in out.attentions) / len(out.attentions))
    model.set_attn_implementation(impl)
    model.train()
    return {"attn_entropy": ents, "resid_norm": round(norm, 2), "attn_saturated": round(sat, 3)}


def pretrain(model, tok, docs, a, dev, rng):
    opt = make_opt(model, a.pt_lr, a.wd)
    stream = []
    order = list(range(len(docs)))
    toks = [[tok.bos_token_id] + tok(d, add_special_tokens=False).input_ids + [tok.eos_token_id] for d in docs]
    L = a.seq_len
    step, t0, losses = 0, time.time(), []
    while step < a.pretrain_steps:
        rng.shuffle(order)
        stream = [t for i in order for t in toks[i]]
        n = len(stream) // L
        chunks = torch.tensor(stream[: n * L], device=dev).view(n, L)
        for b in range(0, n - a.pt_batch + 1, a.pt_batch):
            x = chunks[b:b + a.pt_batch]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
                loss = model(input_ids=x, labels=x).loss
            step_opt(model, opt, loss, lr_at(step, a.pretrain_steps, a.pt_warmup, a.pt_lr))
            losses.append(float(loss))
            step += 1
            if step >= a.pretrain_steps:
                break
    return {"pt_loss": round(sum(losses[-20:]) / 20, 4), "pt_tokens": step * a.pt_batch * L, "pt_s": round(time.time() - t0, 1)}


def sft(model, tok, rows, a, dev, rng, eval_rows):
    opt = make_opt(model, a.sft_lr, a.wd)
    exs = []
    for r in rows:
        p = tok(r["prompt"]).input_ids
        resp = tok(r["response"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        exs.append((p + resp, [0] * len(p) + [1] * len(resp)))
    t0, curve = time.time(), []
    for step in range(a.sft_steps):
        batch = rng.sample(exs, a.sft_batch)
        ids, att = pad([e[0] for e in batch], tok.pad_token_id, dev)
        mask, _ = pad([e[1] for e in batch], 0, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        lp = torch.gather(logits.log_softmax(-1), -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        m = mask[:, 1:].float()
        loss = -(lp * m).sum() / m.sum()
        step_opt(model, opt, loss, lr_at(step, a.sft_steps, a.sft_warmup, a.sft_lr, sched=a.sft_sched))
        if a.curve and (step + 1) % a.curve == 0:
            curve.append(round(greedy_acc(model, tok, eval_rows, dev), 3))
    return {"sft_s": round(time.time() - t0, 1), "sft_curve": curve}


@torch.no_grad()
def logprob_rank(model, tok, pairs, dev):
    """Fraction of pairs where the policy's log p(chosen) > log p(rejected)."""
    model.eval()
    good = 0
    for p in pairs:
        pr = tok(p["prompt"]).input_ids
        scores = []
        for k in ("chosen", "rejected"):
            resp = tok(p[k], add_special_tokens=False).input_ids + [tok.eos_token_id]
            ids = torch.tensor([pr + resp], device=dev)
            lp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
            scores.append(float(lp[len(pr) - 1:].sum()))
        good += scores[0] > scores[1]
    model.train()
    return good / len(pairs)


def rm_inputs(tok, prompt, resp, read):
    ids = tok(prompt).input_ids + tok(resp, add_special_tokens=False).input_ids
    if read == "suffix":
        return ids + tok("\nVerdict:", add_special_tokens=False).input_ids
    return ids + [tok.eos_token_id] if read == "eos" else ids


def train_rm(lm, tok, pairs, eval_sets, a, dev, rng):

    from transformers import AutoModelForSequenceClassification
    tmp = Path(a.tmp) / f"lm-{a.tag}-{a.seed}"
    lm.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if a.rm_pool == "logprob":  # reference-free implicit reward: the response's summed log-prob
        from transformers import AutoModelForCausalLM
        rm = AutoModelForCausalLM.from_pretrained(tmp).to(dev)
    elif a.rm_pool == "last":
        rm = AutoModelForSequenceClassification.from_pretrained(tmp, num_labels=1).to(dev)
    else:  # a score per token, pooled over the response tokens
        from transformers import AutoModelForTokenClassification
        rm = AutoModelForTokenClassification.from_pretrained(tmp, num_labels=1).to(dev)
    rm.config.pad_token_id = tok.pad_token_id
    if a.rm_head_init:  # the LM's own verdict log-odds: logit(" right") - logit(" wrong")
        right, wrong = (tok(" right", add_special_tokens=False).input_ids, tok(" wrong", add_special_tokens=False).input_ids)
        assert len(right) == len(wrong) == 1, (right, wrong)
        with torch.no_grad():
            W = lm.get_output_embeddings().weight
            rm.score.weight.copy_((W[right[0]] - W[wrong[0]]).unsqueeze(0).to(rm.score.weight.device))
    torch.manual_seed(a.seed)
    opt = make_opt(rm, a.rm_lr, 0.0)

    def scores(batch):
        seqs = [rm_inputs(tok, p["prompt"], p[side], a.rm_read) for side in ("chosen", "rejected") for p in batch]
        plen = [len(tok(p["prompt"]).input_ids) for p in batch] * 2
        ids, att = pad(seqs, tok.pad_token_id, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            out = rm(input_ids=ids, attention_mask=att).logits
        if a.rm_pool == "logprob":
            lp = out[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            pos = torch.arange(1, ids.shape[1], device=dev).unsqueeze(0)
            m = ((pos >= torch.tensor(plen, device=dev).unsqueeze(1)) & att[:, 1:].bool()).float()
            r = (lp * m).sum(-1)
            return r[: len(batch)], r[len(batch):]
        r = out.squeeze(-1).float()
        if a.rm_pool != "last":  # (B, T) per-token scores -> pooled over the response
            pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
            m = ((pos >= torch.tensor(plen, device=dev).unsqueeze(1)) & att.bool()).float()
            r = (r * m).sum(-1) / (m.sum(-1) if a.rm_pool == "mean" else 1.0)
        return r[: len(batch)], r[len(batch):]

    @torch.no_grad()
    def acc(ps):
        rm.eval()
        c, r = scores(ps)
        rm.train()
        return round(float((c > r).float().mean()), 3)

    out = {"rm_init": {k: acc(v) for k, v in eval_sets.items()}}
    t0, curve = time.time(), []
    for step in range(a.rm_steps):
        batch = rng.sample(pairs, a.rm_batch)
        c, r = scores(batch)
        loss = -F.logsigmoid(c - r).mean()
        step_opt(rm, opt, loss, lr_at(step, a.rm_steps, a.rm_warmup, a.rm_lr))
        if a.curve and (step + 1) % max(1, a.curve // 4) == 0:
            curve.append(acc(eval_sets["near"]))
    out.update({"rm": {k: acc(v) for k, v in eval_sets.items()}, "rm_curve": curve, "rm_s": round(time.time() - t0, 1)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--carry", action="store_true")
    ap.add_argument("--operands", type=int, default=2)
    ap.add_argument("--ops", default="+-")
    ap.add_argument("--slip", default="none")
    ap.add_argument("--slip-rate", type=float, default=0.75)
    ap.add_argument("--max-value", type=int, default=99)
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--formats", default="qa,eq,judge_nl")
    ap.add_argument("--corpus-problems", type=int, default=100000)
    ap.add_argument("--pretrain-steps", type=int, default=600)
    ap.add_argument("--pt-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--pt-lr", type=float, default=2e-3)
    ap.add_argument("--pt-warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--sft-lr", type=float, default=5e-4)
    ap.add_argument("--sft-warmup", type=int, default=20)
    ap.add_argument("--sft-sched", default="cosine")
    ap.add_argument("--sft-wrong", type=float, default=0.1)
    ap.add_argument("--rm-steps", type=int, default=150)
    ap.add_argument("--rm-batch", type=int, default=32)
    ap.add_argument("--rm-lr", type=float, default=3e-4)
    ap.add_argument("--rm-warmup", type=int, default=10)
    ap.add_argument("--rm-read", default="eos")
    ap.add_argument("--rm-head-init", action="store_true")
    ap.add_argument("--rm-pool", default="last")
    ap.add_argument("--save-sft", default="")
    ap.add_argument("--rm-from-base", action="store_true")
    ap.add_argument("--num-pref", type=int, default=3000)
    ap.add_argument("--load-sft", default="")
    ap.add_argument("--load-base", default="")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--curve", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tmp", default="/tmp/lab")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TaskConfig(allow_carry=a.carry, sft_wrong_fraction=a.sft_wrong, num_operands=a.operands, max_value=a.max_value,
                     operations=tuple(a.ops), sft_slip=a.slip, sft_slip_rate=a.slip_rate, num_pref=a.num_pref)
    splits = generate_task(cfg, a.data_seed)
    held = {r["prompt"][3:-4] for n in ("eval", "eval_pref") for r in splits[n]}
    rng = random.Random(a.seed)
    docs = corpus_docs(cfg, random.Random(a.data_seed + 17), a.corpus_problems, held, a.formats.split(","))
    assert not any(f"Q: {h}= A:" in d or d.startswith(h + "=") for d in docs[:2000] for h in list(held)[:50])
    tok = build_tokenizer(docs[:20000] + [r["prompt"] + r["response"] for r in splits["sft"]], 320)
    model = build_model(tok, a.arch, a.hidden, a.layers, a.seed).to(dev)
    res = {"tag": a.tag, "seed": a.seed, "args": vars(a), "docs": len(docs), "params": sum(p.numel() for p in model.parameters())}
    res["diag_init"] = diagnostics(model, tok, splits["eval"], dev)
    if a.load_base:  # someone else's pretrained model: run sft (and rm) on it
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.load_base)
        model = AutoModelForCausalLM.from_pretrained(a.load_base).to(dev)
        a.pretrain_steps = 0
        res["acc_base"] = greedy_acc(model, tok, splits["eval"], dev)
    if a.load_sft:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.load_sft)
        model = AutoModelForCausalLM.from_pretrained(a.load_sft).to(dev)
        a.pretrain_steps = a.sft_steps = 0
    if a.pretrain_steps:
        res.update(pretrain(model, tok, docs, a, dev, rng))
        res["acc_base"] = greedy_acc(model, tok, splits["eval"], dev)
        res["diag_base"] = diagnostics(model, tok, splits["eval"], dev)
        if a.rm_from_base:
            import copy
            base_model = copy.deepcopy(model)
    res.update(sft(model, tok, splits["sft"], a, dev, rng, splits["eval"]))
    res["acc_sft"] = greedy_acc(model, tok, splits["eval"], dev)
    if a.save_sft:
        model.save_pretrained(a.save_sft)
        tok.save_pretrained(a.save_sft)
    res["diag_sft"] = diagnostics(model, tok, splits["eval"], dev)
    near = splits["eval_pref"]
    rrng = random.Random(5)
    rand = []
    for r in splits["eval"]:
        v = int(r["label"])
        x = v
        while x == v:
            x = rrng.randint(0, 2 * cfg.max_value)
        rand.append({"prompt": r["prompt"], "chosen": " " + r["label"], "rejected": " " + answer_text(cfg, x)})
    res["sft_logprob_rank"] = logprob_rank(model, tok, near[:100], dev)
    if a.rm_steps:
        res.update(train_rm(base_model if a.rm_from_base else model, tok, splits["pref"], {"near": near, "random": rand}, a, dev, rng))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
