"""Turn a StepPlan into model calls: reserve pages, pack spans, split nano-batches, run,
sample, then commit the cache (or roll it back and find the span that failed)."""

from __future__ import annotations

import contextlib
import logging

import torch

from streamgrok.cache.contract import SequenceCache
from streamgrok.engine.plan import Span, StepPlan
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.llama import Transformer
from streamgrok.model.sampling import sample
from streamgrok.stream_tokens import TokenInfo

log = logging.getLogger(__name__)


class StepThreads:
    """Torch CPU threads per step: `small` for steps of at most `small_tokens` tokens
    (decode, memory-bound), `large` for the rest (prefill, compute-bound). Set on the engine
    thread, only when it changes."""

    def __init__(self, small: int, large: int, small_tokens: int) -> None:
        self.small, self.large, self.small_tokens = max(1, small), max(1, large), small_tokens
        self.current = torch.get_num_threads()

    @classmethod
    def for_cpu(cls, small: int | None, small_tokens: int) -> StepThreads:
        """Steps use torch's configured threads; small ones `small` (default: the same)."""
        large = torch.get_num_threads()
        return cls(large if small is None else small, large, small_tokens)

    def adopt(self) -> None:
        """Take these counts on the calling thread (the engine's, as it starts): torch's
        thread count is process-wide, but a library loaded since the counts were chosen may
        have changed it."""
        torch.set_num_threads(self.large)
        self.current = self.large

    def restore(self) -> None:
        """Back to the step threads (torch's thread count is process-wide)."""
        self.use_for(self.small_tokens + 1)

    def use_for(self, tokens: int) -> None:
        wanted = self.small if tokens <= self.small_tokens else self.large
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted


class ModelRunner:
    """Runs one engine step on the model and returns a sampled token per sampling span."""

    def __init__(self, model: Transformer, cache: SequenceCache, nano_batches: int = 1,
                 length_ratio: float = 0.8, threads: StepThreads | None = None) -> None:
        self.model = model
        self.threads = threads
        self.cache = cache  # the step's pages: reserve, then commit or roll back
        self.backend = cache.attention  # what the model's forward passes attend through
        self.nano_batches = nano_batches
        self.length_ratio = length_ratio
        self.device = model.device
        self.streams = None
        if self.device.type == "cuda" and nano_batches > 1:
            self.streams = [torch.cuda.Stream(self.device) for _ in range(nano_batches)]

    def execute(self, plan: StepPlan) -> tuple[dict[int, int], dict[int, Exception]]:
        """Run the plan on pages reserved before the forward pass. If it fails, the cache is
        rolled back and each span runs alone, so the failure is attributed to the span that
        caused it and the others still make progress. Returns (sampled, failed) by span."""
        try:
            return self._run_reserved(plan), {}
        except Exception as exc:
            if len(plan.spans) == 1:
                log.exception("engine step failed")
                return {}, {0: exc}
        sampled, failed = {}, {}
        for index, span in enumerate(plan.spans):
            try:
                got = self._run_reserved(StepPlan([span]))
            except Exception as exc:  # a bad input must not take the engine down
                log.exception("engine step failed for sequence %d", span.seq_id)
                failed[index] = exc
                continue
            if 0 in got:
                sampled[index] = got[0]
        return sampled, failed

    def _run_reserved(self, plan: StepPlan) -> dict[int, int]:
        if self.threads is not None:
            self.threads.use_for(sum(len(span) for span in plan.spans))
        self.cache.reserve(plan.token_counts())
        try:
            sampled = self.run(plan)
        except BaseException:
            self.cache.rollback()
            raise
        self.cache.commit()
        return sampled

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> dict[int, int]:
        """Execute the plan; returns {span index: sampled token} for spans that sample."""
        groups = self.split(plan.spans)
        parts = [self._pack([plan.spans[i] for i in group]) for group in groups]
        if len(parts) == 1 or self.nano_batches == 1:  # one pass each (decode_apart)
            logits = [self.model(ids, batch, self.backend) for ids, batch in parts]
        else:
            streams = self.streams[: len(parts)] if self.streams else None
            logits = self._forward_nano(parts, streams)
        sampled: dict[int, int] = {}
        for group, part_logits in zip(groups, logits):
            sampling = [i for i in group if plan.spans[i].samples]
            if not sampling:
                continue
            answers = [plan.spans[i].answer for i in sampling]
            tokens = sample(part_logits, [a.sampling for a in answers],
                            [a.generator for a in answers], [a.generated for a in answers])
            sampled.update(zip(sampling, tokens.tolist()))  # one host sync per nano-batch
        return sampled

    def _forward_nano(self, parts: list[tuple[torch.Tensor, BatchMetadata]],
                      streams: list | None) -> list[torch.Tensor]:
        """Several nano-batches layer by layer, interleaved (NanoFlow).

        With CUDA `streams` (one per part) each nano-batch's kernels queue on its own stream,
        so one part's attention (memory-bound) overlaps another's GEMMs (compute-bound). On CPU
        the parts run in turn and give the same results as separate forward passes.
        """
        model = self.model
        contexts = [_stream_context(streams[i] if streams else None) for i in range(len(parts))]
        xs = []
        for (ids, batch), ctx in zip(parts, contexts):
            with ctx:
                self.backend.prepare(batch)
                xs.append(model.embed_tokens(ids, batch))
        for layer in model.layers:
            for i, ((_, batch), ctx) in enumerate(zip(parts, contexts)):
                with ctx:
                    xs[i] = layer(xs[i], batch, self.backend, model.kernels)
        outs = []
        for x, (_, batch), ctx in zip(xs, parts, contexts):
            with ctx:
                outs.append(model.logits(x, batch))
        if streams:
            for stream in streams:
                torch.cuda.current_stream().wait_stream(stream)
        return outs

    def split(self, spans: list[Span]) -> list[list[int]]:
        """Indices of spans per nano-batch: decode spans sorted by cache length and cut where
        lengths stop being similar (less padding), prefill spans dealt out by size. Without
        nano-batches, decode and prefill spans part where `decode_apart`."""
        count = min(self.nano_batches, len(spans))
        decode = [i for i, s in enumerate(spans) if s.is_decode]
        prefill = [i for i, s in enumerate(spans) if not s.is_decode]
        if count <= 1:
            if decode and prefill and self.decode_apart():
                return [decode, prefill]
            return [list(range(len(spans)))]
        lengths = {i: self._cache_length(spans[i].seq_id) for i in decode}
        decode.sort(key=lambda i: lengths[i])
        groups: list[list[int]] = [[] for _ in range(count)]
        per_group = -(-len(decode) // count) if decode else 0
        g = 0
        for i in decode:
            group = groups[g]
            too_different = group and lengths[group[0]] < self.length_ratio * lengths[i]
            if group and (len(group) >= per_group or too_different) and g < count - 1:
                g += 1
            groups[g].append(i)
        for i in sorted(prefill, key=lambda i: -len(spans[i])):
            min(groups, key=lambda grp: sum(len(spans[j]) for j in grp)).append(i)
        return [sorted(grp) for grp in groups if grp]

    def decode_apart(self) -> bool:
        """Whether a step's decode tokens run as a pass of their own, apart from its prefill
        chunks: where the model's decode steps over the paged cache are one native call
        (which takes decode-only batches), the rest of the step runs layer by layer."""
        whole = getattr(self.model, "paged_native", None)
        return whole is not None and whole.enabled and whole.step is not None

    def _cache_length(self, seq_id: int) -> int:
        return max(self.cache.layer_lengths(seq_id))

    def _pack(self, spans: list[Span]) -> tuple[torch.Tensor, BatchMetadata]:
        ids = torch.cat([s.token_ids for s in spans]).to(self.device)
        batch = BatchMetadata.build([s.seq_id for s in spans], [len(s) for s in spans],
                                    self.device)
        batch.token_info = TokenInfo.concat([s.info for s in spans])
        ends = torch.tensor([len(s) for s in spans]).cumsum(0) - 1
        batch.logit_rows = ends[[s.samples for s in spans]].to(self.device)
        rows, values, offset = [], [], 0
        for span in spans:
            for row, vectors in span.embeddings:
                rows.append(torch.arange(offset + row, offset + row + vectors.shape[0]))
                values.append(vectors)
            offset += len(span)
        if rows:
            batch.embed_rows = torch.cat(rows).to(self.device)
            batch.embed_values = torch.cat(values).to(self.device)
        return ids, batch


def _stream_context(stream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
