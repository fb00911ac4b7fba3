"""Recall's scoring of one layer's host pages as one expression, compiled on the CPU.

Scoring a layer (`streamgrok.cache.tiers.recall`) rotates the question's queries, the resident keys
and the page centers, takes the queries' log-sum-exp over the resident keys, bounds and
estimates every page's attention and sums what each page would add to the estimated hit rate
(`page_gains`, so what leaves the expression is a few numbers per page). Run as separate
eager calls that was ~1.7 ms of a question's pass per layer on two cores (half of what recall
cost there); as one expression it is ~0.7 ms eagerly and ~0.3 ms compiled by inductor, which
fuses the rotations into the products. `PageScorer` compiles it once on a background thread
(`BackgroundCompiles`), with dynamic shapes, and runs it eagerly until then, where compilation
is off (STREAMGROK_COMPILED_READS=0, as the paged reads) or off the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamgrok.cache.tiers.recall import causal_logits, page_gains, score_pages
from streamgrok_kernels.background_compile import (
    BackgroundCompiles,
    CallContext,
    LazyCompile,
    call_context,
    in_autograd_mode,
    stand_in,
)
from streamgrok_kernels.paged_read import compiled_reads_by_default
from streamgrok_kernels.rotary import rotated

ScoreFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
    c = cos.index_select(0, positions)[:, None, :].to(x.dtype)
    s = sin.index_select(0, positions)[:, None, :].to(x.dtype)
    return rotated(x, c, s)


def layer_page_scores(q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                      centers: torch.Tensor, insert_at: torch.Tensor, radii: torch.Tensor,
                      plane_vars: torch.Tensor, counts: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`score_pages`, then `page_gains`, for queries q [R, H, D] (unrotated, at cache
    positions [R]) against resident keys [n, kvh, D] (unrotated, key i at cache position i)
    and host pages with unrotated centers [P, kvh, D] taking positions `insert_at` [P];
    cos/sin tables [> every position, D/2]. Returns (page scores [P], each page's gain to
    the estimated hit rate [P], that rate with no page taken [])."""
    q_rot = _rotate(q.float(), positions, cos, sin)
    k_rot = _rotate(keys.float(), torch.arange(keys.shape[0], device=keys.device), cos, sin)
    lse = torch.logsumexp(causal_logits(q_rot, k_rot, positions, scale), dim=-1)
    centers_rot = _rotate(centers.float(), insert_at, cos, sin)
    score, mass = score_pages(q_rot, lse, centers_rot, radii.float(), plane_vars.float(),
                              counts, scale)
    return (score, *page_gains(mass))


class PageScorer:
    """Runs `layer_page_scores`, compiled once ready (see the module's docstring)."""

    def __init__(self, compiled: bool | None = None) -> None:
        """`compiled`: None follows `compiled_reads_by_default()`."""
        if compiled is None:
            compiled = compiled_reads_by_default()
        self._function: ScoreFn | None = None
        if compiled and hasattr(torch, "compile"):
            self._function = LazyCompile(layer_page_scores, dynamic=True)
        self._compiles = BackgroundCompiles("recall page scoring")

    @property
    def compiled(self) -> bool:
        """Whether scoring may run compiled (False when off or once a compilation failed)."""
        return self._function is not None and self._compiles.error is None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a compilation under way (benchmarks, before they time)."""
        return self._compiles.wait(timeout)

    def compiled_kinds(self) -> int:
        """How many kinds of scoring are compiled and in use."""
        return self._compiles.ready_count()

    def __call__(self, q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                 centers: torch.Tensor, insert_at: torch.Tensor, radii: torch.Tensor,
                 plane_vars: torch.Tensor, counts: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # contiguous, as the stand-ins it compiles on (a strided view would fail their guards)
        args = (*(t.contiguous() for t in (q, positions, keys, centers, insert_at, radii,
                                           plane_vars, counts, cos, sin)), scale)
        function = self._function
        if not self.compiled or q.device.type != "cpu":
            return layer_page_scores(*args)
        # a size of 1 is specialized by the compiler: such calls are a kind of their own
        ones = (q.shape[0] == 1, keys.shape[0] == 1, centers.shape[0] == 1)
        context = call_context(args[:-1])
        kind = (q.dtype, keys.dtype, centers.dtype, q.shape[1], keys.shape[1], q.shape[2], ones,
                context)
        if not self._compiles.is_ready(kind):
            self._compiles.start(kind, lambda: _compile_kind(function, args, ones, context))
            return layer_page_scores(*args)
        try:
            return function(*args)
        except Exception as error:  # a recompilation that failed
            self._compiles.turn_off(error)
            return layer_page_scores(*args)


def _compile_kind(function: ScoreFn, args: tuple, ones: tuple[bool, bool, bool],
                  context: CallContext) -> None:
    """Compile on stand-ins of the call's kind whose sizes share no value with each other
    (dynamic shapes would otherwise assume a coincidence holds), 1 where the call's is, in
    the call's autograd mode, each an inference tensor where the call's is."""
    q, positions, keys, centers, insert_at, radii, plane_vars, counts, cos, sin, scale = args
    rows, resident, pages = (1 if one else size for one, size in zip(ones, (7, 263, 101)))
    table = 389
    heads, kv_heads, dim = q.shape[1], keys.shape[1], q.shape[2]
    with in_autograd_mode(context):
        function(
            stand_in(q, lambda: torch.zeros(rows, heads, dim, dtype=q.dtype)),
            stand_in(positions, lambda: torch.arange(resident - rows, resident).clamp(min=0)),
            stand_in(keys, lambda: torch.zeros(resident, kv_heads, dim, dtype=keys.dtype)),
            stand_in(centers, lambda: torch.zeros(pages, kv_heads, dim, dtype=centers.dtype)),
            stand_in(insert_at, lambda: torch.arange(pages) % resident),
            stand_in(radii, lambda: torch.zeros(pages, kv_heads, dtype=radii.dtype)),
            stand_in(plane_vars,
                     lambda: torch.zeros(pages, kv_heads, dim // 2, dtype=plane_vars.dtype)),
            stand_in(counts, lambda: torch.full((pages,), 16, dtype=counts.dtype)),
            stand_in(cos, lambda: torch.zeros(table, dim // 2, dtype=cos.dtype)),
            stand_in(sin, lambda: torch.zeros(table, dim // 2, dtype=sin.dtype)), scale)
