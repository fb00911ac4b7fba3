"""The cache's recall: which host-tier pages come back into an answer's fork, and when.

Two ways in, one rule (`streamgrok.cache.tiers.recall`):

* in the pass (what the engine does): `arm(seq)` before the answer's question is prefilled;
  at every layer of that forward pass, before the question's attention, the question's own
  queries at that layer score the layer's host pages and the best come back, so the question
  attends over them and its keys and values above are computed with them;
* explicitly: `capture(seq)`, a forward pass that records the last queries, then `recall(seq)`;
* in the stream (`CacheConfig.recall_in_stream`): a streamed chunk of the sequence that owns
  the host pages recalls in its own pass as a question does (its queries spread over the
  chunk), so the keys and values it stores above the first layer are computed over what it
  attends to, as the full cache's would be. This is a tier change, not a copy: once the step
  commits the recalled pages leave the host tier, and eviction sends back what the working
  set needs least; a step that fails puts each layer back as it was (`end_step`).

Owned by one PagedKVCache and used on its thread only; it acts on the cache's core (pages,
records, the open step), which it is given, not on the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from streamgrok.cache.attention_plan import AttentionPlan, SpanGroup, refresh_layer
from streamgrok.cache.core import CacheCore
from streamgrok.cache.records import SequenceState
from streamgrok.cache.tiers.host_tier import TierLayer, stand_in_layer
from streamgrok.cache.tiers.page_scorer import PageScorer
from streamgrok.cache.tiers.recall import (
    PageChoice,
    QueryCapture,
    RecallResult,
    attention_scale,
    choose_pages,
    insert_tokens,
    rotate,
)
from streamgrok.cache.tokens import STREAM, LayerTokens
from streamgrok.errors import CacheFullError
from streamgrok_kernels.paged_read import COMPILED_MIN_TOKENS


@dataclass
class _Armed:
    """A recall that runs layer by layer inside the sequence's next forward pass."""

    room: int
    min_hit_rate: float
    result: RecallResult
    hits: list[float] = field(default_factory=list)
    bytes_before: int = 0
    stream: bool = False  # a streamed chunk of the tier's own sequence (its pages move)


@dataclass
class _Moved:
    """A layer a streamed chunk's recall changed, held until its step commits or fails."""

    rec: LayerTokens
    old_pages: list[int]  # the layer's pages before the recall, not yet released
    old_meta: torch.Tensor
    old_score: torch.Tensor
    old_length: int
    tier_layer: TierLayer
    index: torch.Tensor  # the host pages that came back, ascending


class Recaller:
    """Recall for the sequences of one cache, acting on its core."""

    def __init__(self, core: CacheCore) -> None:
        self.core = core
        self._captures: dict[int, QueryCapture] = {}
        self._armed: dict[int, _Armed] = {}
        self._done: dict[int, RecallResult] = {}
        self._moved: list[_Moved] = []  # this step's streamed-chunk recalls, in order
        self.scorer = PageScorer()
        self._rehearsed = False  # whether the scorer has seen a question's kind of call

    @property
    def active(self) -> bool:
        return bool(self._captures or self._armed)

    def forget(self, seq_id: int) -> None:
        for table in (self._captures, self._armed, self._done):
            table.pop(seq_id, None)

    # -- in the pass -----------------------------------------------------------------------

    def arm(self, seq_id: int, room: int, min_hit_rate: float) -> None:
        """Recall inside the sequence's next forward pass, keeping `room` positions free."""
        seq = self.core.sequences[seq_id]
        self._armed[seq_id] = _Armed(room, min_hit_rate,
                                     RecallResult(layer_tokens=[0] * len(seq.layers)),
                                     bytes_before=self._tier_bytes())

    def arm_stream(self, seq_id: int) -> bool:
        """Recall inside the next pass of a streamed chunk of `seq_id` when it owns host
        pages (a session's stream, not an answer's fork) and is not armed already; returns
        whether it was armed."""
        seq = self.core.sequences[seq_id]
        tier = self.core.tier
        if seq_id in self._armed or tier is None or seq.tier_source != seq_id or \
                not any(layer.num_pages for layer in tier.sequences.get(seq_id, [])):
            return False
        config = self.core.config
        threshold = config.recall_stream_min_hit_rate
        self._armed[seq_id] = _Armed(0, config.recall_min_hit_rate if threshold is None
                                     else threshold,
                                     RecallResult(layer_tokens=[0] * len(seq.layers)),
                                     stream=True)
        return True

    def end_step(self, committed: bool) -> None:
        """The step's streamed-chunk recalls are kept (`committed`: the recalled pages leave
        the host tier, the layers' old pages are released) or undone (each layer exactly as
        before its recall, the host pages untouched); a streamed recall whose pass did not
        reach its last layer is disarmed."""
        for seq_id in [s for s, armed in self._armed.items() if armed.stream]:
            del self._armed[seq_id]
        moved, self._moved = self._moved, []
        pool = self.core.pool
        for move in moved if committed else reversed(moved):
            if committed:
                pool.release(move.old_pages)
                self.core.tier.restore(move.tier_layer, move.index)
            else:
                pool.release(move.rec.pages)
                move.rec.put_back(move.old_pages, move.old_meta, move.old_score,
                                  move.old_length)

    def take(self, seq_id: int) -> RecallResult | None:
        """The result of the sequence's in-pass recall, once its pass has run."""
        return self._done.pop(seq_id, None)

    def before_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                         plan: AttentionPlan) -> AttentionPlan:
        """Recall into `layer` for the armed sequences of this step, before its new K/V
        (`k`, unrotated, rows as `q`'s) are stored; returns the plan, with that layer
        updated where its tokens moved."""
        moved = False
        last = layer == len(self.core.budgets) - 1
        for seq_id, row, count in plan.spans:
            armed = self._armed.get(seq_id)
            if armed is None:
                continue
            started = time.perf_counter()
            start = plan.starts[seq_id][layer]
            config = self.core.config
            keep = config.recall_stream_queries if armed.stream else config.recall_queries
            picked = _query_rows(count, keep, armed.stream).to(q.device)
            queries = (q[row : row + count][picked], start + picked)
            added = self._recall_layer(self.core.sequences[seq_id], layer, queries, start,
                                       armed.room, armed.min_hit_rate, armed.result,
                                       armed.hits, own_keys=k[row : row + count],
                                       stream=armed.stream)
            if added:
                plan.starts[seq_id][layer] = start + added
                moved = True
            armed.result.seconds += time.perf_counter() - started
            if last:
                del self._armed[seq_id]
                if armed.stream:
                    self.core.tier.stats.stream_recalls += 1
                else:
                    self._done[seq_id] = self._finish(armed.result, armed.hits,
                                                      armed.bytes_before)
        if moved:
            records = {s: self.core.sequences[s].layers for s, _, _ in plan.spans}
            refresh_layer(plan, layer, records, self.core.config.page_size)
        if last and self._moved and not self.core.reserved:
            self.end_step(committed=True)  # no step to fail (a pass run without `reserve`)
        return plan

    @property
    def rehearsal_due(self) -> bool:
        """Whether `rehearse` still has work: a CPU cache whose scorer compiles (elsewhere
        nothing is compiled) and has not been called."""
        return (not self._rehearsed and self.core.tier is not None and self.scorer.compiled
                and self.core.device.type == "cpu")

    def rehearse(self, layer: int, q: torch.Tensor, plan: AttentionPlan) -> None:
        """Score two stand-in host pages (`stand_in_layer`: the chunk's sequence's first keys)
        once with a streamed chunk's queries in place of a question's, the result unused, so
        that the scorer's compilation (seconds, on a background thread) starts with the
        stream instead of with the first question that recalls: a compilation under way
        holds the interpreter's lock for most of its time, and the model thread, which takes
        that lock back after every operator, ran that question's pass ~10x slower (a live
        demo's first recalling question: TTFT 3.9 s against 0.3 s with compiled scoring
        off). The same dtypes, sizes and autograd mode as a question's call (a chunk of
        several tokens, the engine's thread) make the same kind of call."""
        core = self.core
        for seq_id, row, count in plan.spans:
            resident = plan.starts[seq_id][layer]
            if count < 2 or resident < 2:
                continue
            rec = core.sequences[seq_id].layers[layer]
            keys, _ = core.pool.read(rec.slots(0, 2).to(core.device))
            keep = core.config.recall_queries
            positions = torch.arange(resident, resident + count, device=q.device)[-keep:]
            self.choose(rec, resident, stand_in_layer(keys, core.config.page_size),
                        (q[row : row + count][-keep:], positions), budget=0, cap=0,
                        min_hit_rate=0.0)
            self._rehearse_long_read(rec, resident, q.dtype)
            self._rehearsed = True
            return

    def _rehearse_long_read(self, rec, resident: int, dtype: torch.dtype) -> None:
        """Read one sequence's keys as a question's attention over recalled pages will (more
        tokens than the paged reader compiles for), so that kind of read compiles with the
        stream too: a stream whose budget stays under that length never reads so many."""
        core = self.core
        width = COMPILED_MIN_TOKENS
        slots = rec.slots(0, resident).to(core.device).repeat(width // resident + 1)[:width]
        cos, sin = core.rotary.tables(width)
        core.kernels.paged_reader.read(core.pool.paged_kv(), slots[None], cos, sin, dtype)

    # -- explicitly ------------------------------------------------------------------------

    def capture(self, seq_id: int, keep: int) -> None:
        self._captures[seq_id] = QueryCapture(keep)

    def captured(self, seq_id: int) -> QueryCapture | None:
        return self._captures.get(seq_id)

    def record_queries(self, layer: int, q: torch.Tensor, group: SpanGroup) -> None:
        start = 0
        for seq_id, count in zip(group.seq_ids, group.counts):
            capture = self._captures.get(seq_id)
            if capture is not None:
                rows = group.rows[start : start + count].to(q.device)
                capture.add(layer, q[rows], group.positions[layer, start : start + count])
            start += count

    def recall(self, seq_id: int, room: int) -> RecallResult:
        """Recall for the queries `capture` recorded (the whole sequence is resident)."""
        started = time.perf_counter()
        seq = self.core.sequences[seq_id]
        capture = self._captures.pop(seq_id, None)
        result = RecallResult(layer_tokens=[0] * len(seq.layers))
        if capture is None or not self._has_tier(seq):
            return result
        before, hits = self._tier_bytes(), []
        for layer, rec in enumerate(seq.layers):
            queries = capture.layers[layer] if layer < len(capture.layers) else None
            if queries is None:
                hits.append(1.0)
                continue
            self._recall_layer(seq, layer, queries, rec.length, room,
                               self.core.config.recall_min_hit_rate, result, hits)
        result.seconds = time.perf_counter() - started
        return self._finish(result, hits, before)

    # -- one layer -------------------------------------------------------------------------

    def _recall_layer(self, seq: SequenceState, layer: int, queries, resident: int,
                      room: int, min_hit_rate: float, result: RecallResult,
                      hits: list[float], own_keys: torch.Tensor | None = None,
                      stream: bool = False) -> int:
        """Bring the chosen pages into one layer; returns tokens added. `resident`: how many
        of the layer's leading tokens hold keys (the rest are this step's, not yet stored:
        `own_keys`, unrotated, which the queries attend too). `stream`: the pages move into
        the tier's own sequence (`end_step` completes or undoes that) instead of being copied
        into an answer's fork, which may hold them beyond its budget."""
        core = self.core
        tier_layer = core.tier.layer(seq.tier_source, layer) if self._has_tier(seq) else None
        if tier_layer is None or tier_layer.num_pages == 0:
            hits.append(1.0)
            return 0
        rec = seq.layers[layer]
        cap = max(0, core.model_config.max_positions - room - rec.length)
        budget = core.config.recall_tokens or core.budgets[layer] or 0
        choice = self.choose(rec, resident, tier_layer, queries, budget, cap, min_hit_rate,
                             own_keys)
        hits.append(choice.hit_rate)
        result.guard |= choice.guard
        result.limited |= choice.limited
        if not choice.index.numel():
            return 0
        index = torch.sort(choice.index).values
        k, v, meta = core.tier.read(tier_layer, index)
        before = (rec.meta, rec.score, rec.length)
        try:
            old_pages = insert_tokens(core.pool, core.kernels, rec, k, v, meta,
                                      release_old=not stream)
        except CacheFullError:
            result.limited = True
            return 0
        if stream:
            self._moved.append(_Moved(rec, old_pages, *before, tier_layer, index))
        else:
            seq.budget_bonus[layer] += k.shape[0]
        result.layer_tokens[layer] = k.shape[0]
        return k.shape[0]

    def choose(self, rec, resident: int, tier_layer, queries, budget: int, cap: int,
               min_hit_rate: float, own_keys: torch.Tensor | None = None) -> PageChoice:
        """The recall rule for one layer: queries (unrotated [R, H, D], cache positions [R])
        against the first `resident` tokens of `rec`, then `own_keys` (the queries' chunk's
        keys, not yet stored, at the positions after them), and the host pages of
        `tier_layer`. What a question's tokens draw to themselves is resident mass too."""
        core = self.core
        q, positions = queries
        positions = positions.to(core.device, torch.int64)
        keys, _ = core.pool.read(rec.slots(0, resident).to(core.device))
        if own_keys is not None and own_keys.shape[0]:
            keys = torch.cat([keys, own_keys.to(keys.dtype)])
        cos, sin = core.rotary.tables(max(keys.shape[0], int(positions.max()) + 1))
        insert_at = torch.searchsorted(rec.column(STREAM)[:resident].contiguous(),
                                       tier_layer.first_stream().contiguous())
        score, gain, base = self.scorer(q.to(core.device), positions, keys, tier_layer.centers,
                                  insert_at.to(core.device), tier_layer.radii,
                                  tier_layer.plane_vars, tier_layer.counts, cos, sin,
                                  attention_scale(core.model_config.head_dim))
        return choose_pages(score, gain, base, tier_layer.counts, budget, cap, min_hit_rate)

    def rotated(self, rec, resident: int, queries) -> tuple[torch.Tensor, ...]:
        """The queries (unrotated [R, H, D], cache positions [R]) and the first `resident`
        keys of `rec`, each rotated by its cache position: (q_rot, k_rot, positions, tables)."""
        core = self.core
        q, positions = queries
        positions = positions.to(core.device, torch.int64)
        tables = core.rotary.tables(max(resident, int(positions.max())) + 1)
        q_rot = rotate(core.kernels, q.to(core.device), positions, tables)
        keys, _ = core.pool.read(rec.slots(0, resident).to(core.device))
        k_rot = rotate(core.kernels, keys, torch.arange(resident, device=core.device), tables)
        return q_rot, k_rot, positions, tables

    # -- bookkeeping -----------------------------------------------------------------------

    def _has_tier(self, seq: SequenceState) -> bool:
        tier = self.core.tier
        return tier is not None and seq.tier_source in tier.sequences

    def _tier_bytes(self) -> int:
        tier = self.core.tier
        return 0 if tier is None else tier.stats.recall_bytes

    def _finish(self, result: RecallResult, hits: list[float], bytes_before: int
                ) -> RecallResult:
        result.tokens = sum(result.layer_tokens)
        result.hit_rate = sum(hits) / len(hits) if hits else 1.0
        result.bytes_moved = self._tier_bytes() - bytes_before
        tier = self.core.tier
        if tier is not None:
            stats = tier.stats
            stats.recalls += 1
            stats.recalled_tokens += result.tokens
            stats.guard_recalls += result.guard
            stats.recall_seconds += result.seconds
        return result


def _query_rows(count: int, keep: int, spread: bool) -> torch.Tensor:
    """Which of a chunk's `count` rows score the host pages: the last `keep` (a question:
    its end asks), or `keep` spread evenly over the chunk and ending at its last row (a
    streamed chunk, whose every token attends)."""
    if not spread or count <= keep:
        return torch.arange(max(0, count - keep), count)
    return torch.linspace(0, count - 1, keep).round().to(torch.int64).unique()
