"""Where a grpo rollout's time goes inside vLLM (issue 20): one engine, 64 prompts x 8 samples, the
SamplingParams our engine uses against variants without detokenizing and without per-sample seeds,
interleaved (this machine is noisy), then a cProfile of one call.

    .venv/bin/python bench/vllm_rollout.py MODEL_DIR RL_JSONL     # e.g. the bench project's
        build/bench-vs-trl/artifacts/pretrain/model build/bench-vs-trl/data/rl.jsonl (`make bench` builds it)
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROMPTS, SAMPLES, MAX_TOKENS, REPEATS = 64, 8, 8, 6


def main() -> None:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    torch.set_num_threads(2)
    model, data = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in open(data)][:PROMPTS]
    prompts = [TokensPrompt(prompt_token_ids=tok(r["prompt"])["input_ids"]) for r in rows for _ in range(SAMPLES)]
    # the engine's settings (rlhf_core/rollout/engines.py VLLMEngine)
    llm = LLM(model=model, dtype="float32", max_model_len=64, gpu_memory_utilization=0.05, enforce_eager=True, seed=0,
              logprobs_mode="processed_logprobs", enable_chunked_prefill=False, max_num_batched_tokens=16384)
    variants = {
        "seeded, detokenize": dict(detokenize=True),
        "seeded, no detokenize (ours)": dict(detokenize=False),
        "unseeded, detokenize": dict(detokenize=True, seeded=False),
        "unseeded, no detokenize": dict(detokenize=False, seeded=False),
    }

    def params(v: dict, rep: int) -> list:
        return [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, logprobs=0, detokenize=v["detokenize"],
                               seed=1000 * rep + i if v.get("seeded", True) else None) for i in range(len(prompts))]

    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(REPEATS):
        for name, v in variants.items():
            ps = params(v, rep)
            t = time.perf_counter()
            llm.generate(prompts, ps, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():  # the first repeat warms up
        print(f"{name:30} median {statistics.median(ts[1:]):.3f} s   all {[round(t, 3) for t in ts]}")
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params(variants["seeded, no detokenize (ours)"], REPEATS), use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
