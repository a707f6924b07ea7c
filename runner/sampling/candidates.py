"""The sampler's fast path: filter each row on its few likeliest tokens, not the whole vocabulary.

With a peaked distribution the kept set (top-k, nucleus, min-p) is a handful of tokens, and a
filter over every one of 262,144 logits is mostly wasted passes. Here a row's top candidates
come from one cheap pass of block maxima; the nucleus, min-p and top-k are decided on them by
the dense path's rules (runner/sampling/sampler.py `dense_probs` is the definition); a row whose
kept set may reach past its candidates falls back to a dense row, drawn by a two-level walk.

Every choice below (a row's width, compact or dense) hangs on the row and its own parameters
alone, never on its batch-mates: a seeded request draws the same token in any batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from runner.sampling.params import SamplingParams

BLOCK = 64  # tokens a block maximum stands for in the candidate search (best of 32..256)
TOP_K_WIDEST = 1024  # top-k rows with k below it are filtered on their top logits alone


class Compact(NamedTuple):
    """Rows whose kept tokens all lie among a few candidates."""

    rows: torch.Tensor  # [r] int64: the rows' places in the batch
    ids: torch.Tensor  # [r, w] token ids: the kept ones first, in token-id order
    probs: torch.Tensor  # [r, w] float32 unnormalised mass of each; 0 past the kept ones


class Dense(NamedTuple):
    """Rows whose kept set is too wide for candidates: every token's mass (0 where cut)."""

    rows: torch.Tensor  # [d] int64
    probs: torch.Tensor  # [d, vocab] float32


@dataclass
class Filtered:
    """What `filtered_probs` leaves of a batch of n rows: each row in exactly one group."""

    n: int
    vocab: int
    device: torch.device
    compact: list[Compact] = field(default_factory=list)
    dense: list[Dense] = field(default_factory=list)

    def to_dense(self) -> torch.Tensor:
        """The kept mass of every token [n, vocab] (0 where cut), as the dense path gives it."""
        out = torch.zeros(self.n, self.vocab, device=self.device)
        for group in self.compact:
            rows = torch.zeros(len(group.rows), self.vocab, device=self.device)
            out[group.rows] = rows.scatter(1, group.ids, group.probs)
        for dense in self.dense:
            out[dense.rows] = dense.probs
        return out


def top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest values of each row of `x` [r, vocab], descending [r, width], and
    their token ids [r, width]. Ties at the last value may be broken either way, so callers
    only trust what lies strictly above it.

    Over a wide vocabulary a block's maximum stands for its BLOCK tokens: the top `width`
    tokens lie in the `width` blocks with the largest maxima (a token outside them is beaten
    by each of those maxima), so a pass of block maxima and a top-k over width x BLOCK
    gathered tokens replace a top-k over the whole row, about 10x cheaper."""
    r, vocab = x.shape
    if width >= vocab:
        return torch.sort(x, dim=-1, descending=True)
    blocks = vocab // BLOCK
    if blocks < 4 * width:  # the gathered tokens would be a good part of the row anyway
        top = torch.topk(x, width, dim=-1)
        return top.values, top.indices
    head = x[:, : blocks * BLOCK].unflatten(1, (blocks, BLOCK))  # [r, blocks, BLOCK]
    chosen = torch.topk(head.amax(dim=-1), width, dim=-1).indices  # [r, width]
    offsets = torch.arange(BLOCK, device=x.device)
    ids = (chosen[:, :, None] * BLOCK + offsets).flatten(1)  # [r, width * BLOCK]
    if blocks * BLOCK < vocab:  # the last, partial block always joins
        tail = torch.arange(blocks * BLOCK, vocab, device=x.device)
        ids = torch.cat([ids, tail.expand(r, -1)], dim=1)
    top = torch.topk(x.gather(1, ids), width, dim=-1)
    return top.values, ids.gather(1, top.indices)


def nucleus_at(
    top: torch.Tensor, top_p: torch.Tensor, complete: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's `w` likeliest probabilities `top` [r, w] (descending): the probability
    of the nucleus's least likely token [r], and whether that is settled [r]. In descending
    order a token is in while the mass before it is under top_p [r]."""
    mass = torch.cumsum(top, dim=-1)
    # The top token is always in, even where p is below float32's range and reads as 0.
    inside = ((mass - top) < top_p[:, None]).sum(dim=-1).clamp(min=1)
    floor = top.gather(1, (inside - 1)[:, None])[:, 0]
    # Every one of the w tokens in: the nucleus may reach past them, unless the row is complete
    # or the w-th has no mass (nor has any token past it). Not settled early where their mass
    # reaches p: the next token's mass before it, (mass + next) - next in float32, can round
    # back below p (one ulp under 1.0) and let that token in, as a full sort would; the answer
    # must not hang on the width.
    settled = (inside < top.shape[1]) | (top[:, -1] == 0) | complete
    return floor, settled


def pack(
    rows: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, floor: torch.Tensor, vocab: int
) -> Compact:
    """Candidates `ids`, `probs` [r, w] of `rows`, keeping the tokens with mass of at least
    `floor` [r]: those first, in token-id order, so a draw walks them as the dense one would
    (the tokens cut in between add nothing to its running sums)."""
    kept = (probs >= floor[:, None]) & (probs > 0)
    order = (ids + (~kept) * vocab).argsort(dim=-1)
    return Compact(rows, ids.gather(1, order), probs.masked_fill(~kept, 0.0).gather(1, order))


def softmax_rows(
    out: Filtered,
    logits: torch.Tensor,
    rows: torch.Tensor,
    params: Sequence[SamplingParams],
    widths: Sequence[int],
) -> None:
    """Add to `out` the rows without top-k (`logits` [a, vocab], batch places `rows` [a]).
    Their softmax is the dense path's very numbers; the nucleus and min-p are decided on the
    `widths` likeliest (then the full sort), as the dense path does, and a row goes compact
    where everything it keeps lies strictly above its w-th candidate, else dense."""
    a, vocab = logits.shape
    dev = logits.device
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if all(p.temperature == 1.0 for p in params):  # x / 1 is x, bit for bit
        probs = torch.softmax(logits, dim=-1)  # [a, vocab]
    else:
        probs = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
        # In place on the CPU, where each row's softmax reads it whole before writing it: a
        # fresh 16 MB tensor a step (16 rows of 262,144) costs more in page faults than its math.
        if probs.device.type == "cpu":
            torch.softmax(probs, dim=-1, out=probs)
        else:
            probs = torch.softmax(probs, dim=-1)
    floor = torch.zeros(a, device=dev)  # of the rows that end dense
    # A row without top-p or min-p keeps every token with mass: dense, no candidates needed.
    unfiltered = [p.top_p >= 1.0 and p.min_p <= 0.0 for p in params]
    dense = torch.tensor(unfiltered, dtype=torch.bool, device=dev)
    filtered = [i for i, plain in enumerate(unfiltered) if not plain]
    pending = torch.tensor(filtered, dtype=torch.int64, device=dev)
    for width in (*[w for w in widths if w < vocab], vocab):
        if not pending.numel():
            break
        complete = width >= vocab
        vals, ids = top_candidates(_take(probs, pending), width)
        nucleus = top_p.index_select(0, pending) < 1.0
        at, settled = nucleus_at(vals, top_p.index_select(0, pending), complete)
        at, settled = at.masked_fill(~nucleus, 0.0), settled | ~nucleus
        edge = vals[:, -1]  # no token outside the candidates has more mass
        least = min_p.index_select(0, pending) * vals[:, 0]  # the min-p floor
        # An unsettled nucleus ends at or below the edge: a min-p floor above it decides alone.
        known = settled | (least > edge)
        row_floor = torch.maximum(at.masked_fill(~settled, 0.0), least)
        # After the full sort every row is known; it stays dense rather than sort ids back.
        fits = known & ((edge < row_floor) | (edge == 0)) & ~torch.tensor(complete, device=dev)
        if bool(fits.any()):
            keep = pending[fits]
            out.compact.append(pack(rows[keep], ids[fits], vals[fits], row_floor[fits], vocab))
        wide = known & ~fits
        floor[pending[wide]] = row_floor[wide]
        dense[pending[wide]] = True
        pending = pending[~known]
    where = dense.nonzero()[:, 0]
    if where.numel():
        kept, row_floor = _take(probs, where), floor.index_select(0, where)
        if bool((row_floor > 0).any()):
            kept.masked_fill_(kept < row_floor[:, None], 0.0)
        out.dense.append(Dense(rows[where], kept))


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [r] (ascending, distinct) of `x`: `x` itself where they are all its rows,
    rather than a copy of a tensor as big as the logits."""
    return x if index.numel() == x.shape[0] else x.index_select(0, index)


def top_k_rows(
    out: Filtered, logits: torch.Tensor, rows: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Add to `out` the rows whose top-k is under TOP_K_WIDEST (`logits` [b, vocab], batch
    places `rows` [b]), read on their W likeliest logits (W a power of two above k, at least
    64), which hold every token they keep. Returns the batch places of the rows the dense path
    must take: those whose k-th logit's ties may reach past the W."""
    b, vocab = logits.shape
    dev = logits.device
    widths = [max(64, 1 << p.top_k.bit_length()) for p in params]
    fallback = []
    for width in sorted(set(widths)):  # a row's width is its own k's, never its batch's
        mine = [i for i, w in enumerate(widths) if w == width]
        index, group = torch.tensor(mine, device=dev), [params[i] for i in mine]
        width = min(width, vocab)
        vals, ids = top_candidates(_take(logits, index), width)
        # Division rounds each logit alone: these are the dense path's scaled logits, bit for bit.
        scaled = vals / torch.tensor([p.temperature for p in group], device=dev)[:, None]
        kth = scaled.gather(1, torch.tensor([p.top_k - 1 for p in group], device=dev)[:, None])
        # Every token tied with the k-th is a candidate when the last candidate falls short of
        # it, or has no mass (-inf), as has every token past it.
        last = scaled[:, -1]
        fits = (last < kth[:, 0]) | (last == -math.inf) | torch.tensor(width == vocab, device=dev)
        masked = scaled.masked_fill(scaled < kth, -math.inf)  # [r, width]: the top-k's logits
        top_p = torch.tensor([p.top_p for p in group], device=dev)
        min_p = torch.tensor([p.min_p for p in group], device=dev)
        q, picked, floor = _settle(torch.softmax(masked, dim=-1), ids, top_p, min_p)
        # The candidates' own softmax sums the same masses as the dense path's in another
        # order; where a decision sits within that rounding of its threshold, take the dense
        # path's very probabilities: its softmax over the row with every other token at -inf.
        near = fits & _near_thresholds(q, top_p, floor, min_p * q[:, 0], width)
        if bool(near.any()):
            row = torch.full((int(near.sum()), vocab), -math.inf, device=dev)
            row.scatter_(1, ids[near], masked[near])
            exact = torch.softmax(row, dim=-1).gather(1, ids[near])
            q[near], picked[near], floor[near] = _settle(exact, ids[near], top_p[near], min_p[near])
        if bool(fits.any()):
            out.compact.append(pack(rows[index[fits]], picked[fits], q[fits], floor[fits], vocab))
        fallback.append(rows[index[~fits]])
    return torch.cat(fallback)


def _settle(
    probs: torch.Tensor, ids: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates `probs`, `ids` [r, w] holding every token with mass, sorted by descending
    probability, and the least mass each row keeps [r]: its nucleus's and its min-p floor."""
    probs, order = torch.sort(probs, dim=-1, descending=True)
    at = nucleus_at(probs, top_p, complete=True)[0].masked_fill(top_p >= 1.0, 0.0)
    return probs, ids.gather(1, order), torch.maximum(at, min_p * probs[:, 0])


def _near_thresholds(
    q: torch.Tensor, top_p: torch.Tensor, floor: torch.Tensor, least: torch.Tensor, width: int
) -> torch.Tensor:
    """Rows [r] of descending probabilities `q` [r, w] where a decision sits within rounding of
    its threshold: a mass before a token near top_p, a token near the kept floor `floor`
    other than the one that set it (ties included), a token near the min-p floor `least`.
    Both softmaxes sum the same <= w masses, each within w ulps of the true sum, and every
    mass or cumulative mass moves by that ratio: a margin of 4 (w + 4) ulps covers it."""
    margin = 4 * (width + 4) * 2.0**-24
    has_mass = q > 0
    p = top_p[:, None]
    before = torch.cumsum(q, dim=-1) - q
    near_p = ((before - p).abs() <= margin * p) & has_mass & (p < 1.0)
    f = floor[:, None]
    near_floor = ((q - f).abs() <= margin * f) & has_mass
    m = least[:, None]
    near_min = ((q - m).abs() <= margin * m) & has_mass
    return near_p.any(-1) | (near_floor.sum(-1) > 1) | near_min.any(-1)
