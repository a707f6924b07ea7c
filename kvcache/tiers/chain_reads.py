"""Which stored values a lookup reads: those that continue a chain, up to its first gap.

A tier knows which keys it holds without reading them (``has_many``: a dict, a ``stat``, a
Redis ``EXISTS``, which Redis does not count as a use). From that alone, and the layout the
writers use (``chunk_blocks`` consecutive blocks a value, chunks aligned on the chain from its
top and keyed by their last block; single blocks past a chain's last chunk), the values that
cover the chain from a place on are known before any is read, and nothing past the first block
no value covers is read. That matters on a Redis with ``maxmemory``: LRU evicts values from the
middle of chains, and a value past a gap read anyway costs its bytes and makes it recent, so
LRU would keep it over one that can be served.
"""

from __future__ import annotations

from collections.abc import Container


def plan_reads(
    held: Container[int], tried: Container[int], pos: int, n: int, first: int, chunk_blocks: int
) -> list[int]:
    """The places (0 .. ``n`` - 1 of a lookup; place 0 is block ``first`` of the chain) whose
    values continue the chain from ``pos``, in order, up to its first gap: the block at a place
    is covered by its chunk's value (keyed by the chunk's last block), else by its own. Places
    in ``held`` have a value in some tier; those in ``tried`` were read already (or failed) and
    are not planned again. A value that turns out shorter than its chunk (another layout: the
    host tier's single blocks) only covers less; the lookup checks what each value holds.
    Pure."""
    C, plan = chunk_blocks, []
    while pos < n:
        end = ((first + pos) // C + 1) * C - 1 - first  # the last block of pos's chunk
        if end < n and end in held and end not in tried:
            plan.append(end)
            pos = end + 1
        elif pos in held and pos not in tried:
            plan.append(pos)
            pos += 1
        else:
            break
    return plan
