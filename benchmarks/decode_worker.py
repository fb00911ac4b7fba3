"""One weight format's measurements for `python -m benchmarks decode`, in its own process (so
that its peak RSS is its own): prefill, decode at batch 1 and N sequences, teacher-forced
agreement with the float32 model, and its greedy answers to chat questions against the float32
model's. `python -m benchmarks.decode_worker SPEC.json`."""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.corpus import prose_text
from streamgrok.bench.timing import median, timed
from streamgrok.loading.loader import LoadedModel, load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.compiled_decode import CompiledDecode
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.generate import Generator, kv_cache_dtype
from streamgrok.model.quantized import (
    cache_dtype,
    prefill_attention_dtype,
    wait_native_int4,
    wait_native_int8,
)
from streamgrok.model.sampling import SamplingParams
from streamgrok.runtime import configure_threads, resolve_dtype

# Chat questions whose greedy answers are compared with float32's: teacher-forced agreement
# over prose does not show a format that answers a plain question wrongly.
QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Name the three primary colours of light.",
    "What does a thermometer measure?",
    "Who wrote Romeo and Juliet?",
    "At what temperature does water boil at sea level, in Celsius?",
    "Explain in one sentence what a CPU does.",
    "What is twelve times twelve?",
)
ANSWER_TOKENS = 24

_TEXT = (
    "Streams of video and audio arrive for hours; the engine keeps a bounded cache of what "
    "matters and answers questions about it as they come. "
)


def prompt_ids(loaded: LoadedModel, length: int) -> list[int]:
    """`length` token ids of repeated real text."""
    ids = loaded.tokenizer.encode(_TEXT)
    return (ids * (length // len(ids) + 1))[:length]


def prose_ids(loaded: LoadedModel, length: int) -> list[int]:
    """`length` token ids of English prose (the Python documentation's topics, offline)."""
    return loaded.tokenizer.encode(prose_text(length * 8))[:length]


@torch.inference_mode()
def measure(spec: dict) -> dict:
    """Load the model as `spec` says and time it; returns the numbers as a dict."""
    configure_threads(spec["threads"])
    weights = spec["weights"]
    dtype = resolve_dtype({"f32": "float32", "bf16": "bfloat16"}.get(weights, "float32"))
    loaded = load_model(spec["model"], dtype, "cpu", weights)
    gc.collect()
    model = loaded.model
    kv_dtype = cache_dtype(model) if spec["kv_dtype"] == "auto" else \
        kv_cache_dtype(spec["kv_dtype"])
    out: dict = {"weights": weights, "kv_dtype": str(kv_dtype).removeprefix("torch."),
                 "weight_mb": model.weight_bytes() / 1e6,
                 "decode_read_mb": model.decode_read_bytes() / 1e6}
    out["compile_s"] = _compile_decode(loaded, kv_dtype)
    out["native_int8"] = wait_native_int8(model)
    out["native_int4"] = wait_native_int4(model)

    prompt = torch.tensor(prompt_ids(loaded, spec["prompt_tokens"]))
    cache = _cache(loaded, 1, len(prompt), kv_dtype)
    prefill_batch = BatchMetadata.build([0], [len(prompt)], "cpu")

    def prefill() -> None:
        cache.reset(0)
        model(prompt, prefill_batch, cache)

    prefill()
    out["prefill_tok_s"] = len(prompt) / timed(prefill, torch.device("cpu"))
    for batch in spec["batches"]:
        # batch 1 as llama-bench's tg128 (a short context), sequences at the long context
        context = spec["batch1_context"] if batch == 1 else spec["context"]
        step_s = _decode_step(loaded, batch, context, spec["steps"], kv_dtype)
        out[f"decode_b{batch}_tok_s"] = batch / step_s
        out[f"decode_b{batch}_step_ms"] = step_s * 1e3
        if out["compile_s"] is not None:  # the same steps uncompiled: the baseline
            compiled, model.compiled_decode = model.compiled_decode, CompiledDecode(False)
            step_s = _decode_step(loaded, batch, context, spec["steps"], kv_dtype)
            model.compiled_decode = compiled
            out[f"decode_b{batch}_eager_tok_s"] = batch / step_s
    # the load's peak, before the accuracy pass holds a whole text's logits
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if spec.get("reference_logprobs"):
        out.update(_agreement(loaded, spec, kv_dtype))
    return out


def _cache(loaded: LoadedModel, seqs: int, capacity: int, kv_dtype: torch.dtype
           ) -> ContiguousKVCache:
    """A CPU cache for `seqs` sequences whose prefill attends as the model's format does."""
    return ContiguousKVCache(loaded.config, seqs, capacity, kv_dtype, "cpu",
                             prefill_attention_dtype(loaded.model))


def _compile_decode(loaded: LoadedModel, kv_dtype: torch.dtype) -> float | None:
    """Seconds until the compiled decode steps are in use (one decode step starts their
    compilation); None where decode is not compiled."""
    model = loaded.model
    if not model.compiled_decode.enabled:
        return None
    start = time.perf_counter()
    cache = _cache(loaded, 1, 4, kv_dtype)
    model(torch.tensor([0]), BatchMetadata.build([0], [1], "cpu"), cache)
    if not model.compiled_decode.wait_compiled():
        return None
    return time.perf_counter() - start


def _decode_step(loaded: LoadedModel, batch_size: int, context: int, steps: int,
                 kv_dtype: torch.dtype) -> float:
    """Median seconds of a decode step for `batch_size` sequences at `context` tokens."""
    model = loaded.model
    cache = _cache(loaded, batch_size, context + steps + 2, kv_dtype)
    ids = prompt_ids(loaded, context)
    seqs = list(range(batch_size))
    for seq in seqs:  # one prefill each, as sessions would have
        model(torch.tensor(ids), BatchMetadata.build([seq], [context], "cpu"), cache)
    step_batch = BatchMetadata.build(seqs, [1] * batch_size, "cpu")
    tokens = torch.full((batch_size,), ids[0])
    model(tokens, step_batch, cache)  # warm-up
    return median([timed(lambda: model(tokens, step_batch, cache), torch.device("cpu"))
                   for _ in range(steps)])


def _agreement(loaded: LoadedModel, spec: dict, kv_dtype: torch.dtype) -> dict:
    """Teacher-forced top-1 agreement and KL(float32 || this) on fixed prose, this format
    with its K/V cache in `kv_dtype`; the float32 run writes the reference first (float32
    weights and cache)."""
    ids = torch.tensor(prose_ids(loaded, spec["agreement_tokens"]))
    path = Path(spec["reference_logprobs"])
    answers_path = path.with_name("f32_answers.json")
    logprobs = _logprobs(loaded, ids, kv_dtype)
    answers = greedy_answers(loaded, kv_dtype)
    if spec["weights"] == "f32":
        exact = kv_dtype == torch.float32
        reference = logprobs if exact else _logprobs(loaded, ids, torch.float32)
        np.save(path, reference.numpy())
        answers_path.write_text(json.dumps(
            answers if exact else greedy_answers(loaded, torch.float32)))
    else:
        reference = torch.from_numpy(np.load(path))
    kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
    same = (reference.argmax(-1) == logprobs.argmax(-1)).float().mean().item()
    return {"top1_agreement": same, "kl_nats": max(kl, 0.0), "agreement_tokens": len(ids),
            **answer_agreement(answers, json.loads(answers_path.read_text()))}


def greedy_answers(loaded: LoadedModel, kv_dtype: torch.dtype | None = None
                   ) -> list[list[int]]:
    """The model's greedy answers (token ids, at most ANSWER_TOKENS) to QUESTIONS, batched;
    the K/V cache in `kv_dtype` (None: as `Generator` keeps it, `cache_dtype`)."""
    generator = Generator(loaded, max_batch=len(QUESTIONS), capacity=256, kv_dtype=kv_dtype)
    prompts = [generator.chat_prompt(question) for question in QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    return [answer.token_ids for answer in generator.generate(prompts, greedy)]


def answer_agreement(answers: list[list[int]], reference: list[list[int]]) -> dict:
    """The share of answers identical to the reference's, and the mean share of each
    reference answer's tokens matched before the first difference."""
    prefixes = []
    for mine, theirs in zip(answers, reference, strict=True):
        matched = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                       min(len(mine), len(theirs)))
        prefixes.append(matched / max(len(theirs), 1) if mine != theirs else 1.0)
    return {"greedy_same": sum(a == b for a, b in zip(answers, reference)) / len(reference),
            "greedy_prefix": sum(prefixes) / len(prefixes)}


def _logprobs(loaded: LoadedModel, ids: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    cache = _cache(loaded, 1, len(ids), kv_dtype)
    every_row = BatchMetadata([0], [len(ids)], logit_rows=torch.arange(len(ids)))
    return torch.log_softmax(loaded.model(ids, every_row, cache).float(), dim=-1)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(measure(spec)))


if __name__ == "__main__":
    main()
