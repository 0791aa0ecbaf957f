"""The speculative decoder's configuration and results: TreeConfig, Stats, GenerateOutput."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch


# The tie rule of greedy decoding (module docstring), relative to a step's largest |logit|.
_TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2.0 ** -5}


def tie_tolerance(dtype: torch.dtype) -> float:
    """Greedy's tie rule: at a step where plain greedy decoding's best logit beats every other
    by more than ``tie_tolerance(dtype) * max |logit|`` (the target's logits in ``dtype``),
    :func:`generate` with ``temperature=0`` takes the same token. Closer than that, the tree
    forward's rounding (other matrix shapes than a 1-token step) may pick the other one, and
    the outputs may differ from there on. float32 1e-4, float16 1e-2, bfloat16 2**-5: several
    times the differences measured between the two forwards."""
    if dtype not in _TIE_TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(map(str, _TIE_TOLERANCE))}, got {dtype}")
    return _TIE_TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeConfig:
    """The draft tree's shape, EAGLE's three numbers (defaults: EAGLE's 60 / 7 / 10).

    Attributes:
        total_tokens: tree size including the root (the last committed token), >= 1.
        depth: frontier steps after the root's (the tree reaches depth ``depth + 1``), >= 0.
        top_k: children per expanded node and frontier width, >= 1.

    The tree actually built may be smaller than ``total_tokens`` when depth and top-k cannot
    grow that many candidates: :meth:`size` tells.
    """

    total_tokens: int = 60
    depth: int = 7
    top_k: int = 10

    def __post_init__(self) -> None:
        for name, low in (("total_tokens", 1), ("depth", 0), ("top_k", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TreeConfig.{name} must be an int >= {low}, got {value!r}")

    def shape(self, draft_vocab_size: int) -> "TreeShape":
        """The fixed sizes of the trees this config grows with a draft vocabulary this big:
        :class:`TreeShape` (``size``: nodes, root included; ``path - 1``: the deepest node)."""
        if not isinstance(draft_vocab_size, int) or draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be an int >= 1, got {draft_vocab_size!r}")
        keep = self.total_tokens - 1
        width = min(self.top_k, keep, draft_vocab_size)  # children per expanded node
        frontier, previous = [], width  # frontier widths of steps 1..depth
        if keep > 0:
            for _ in range(self.depth):
                f = min(self.top_k, keep, previous)
                frontier.append(f)
                previous = f * width
        candidates = width * (1 + sum(frontier)) if keep > 0 else 0
        kept = min(keep, candidates)
        # A root-to-leaf path has at most depth + 2 nodes, and no more than the tree has.
        return TreeShape(width=width, frontier=tuple(frontier), candidates=candidates, kept=kept,
                          size=1 + kept, expanded=sum(frontier), path=min(self.depth + 2, 1 + kept))

    def size(self, draft_vocab_size: int) -> int:
        """Nodes of the trees actually built (root included): ``total_tokens`` or fewer."""
        return self.shape(draft_vocab_size).size


@dataclass(frozen=True)
class TreeShape:
    """The fixed sizes of the trees a :class:`TreeConfig` grows (:meth:`TreeConfig.shape`)."""

    width: int  # children of each expanded node
    frontier: Tuple[int, ...]  # frontier width of each step after the root's
    candidates: int  # children created in all steps
    kept: int  # candidates kept in the tree
    size: int  # T: tree nodes, root included
    expanded: int  # tree nodes the draft runs on besides the root (its K/V slots per tree)
    path: int  # P: the longest accepted path, root included; one round emits at most this


@dataclass
class Stats:
    """What a generation did. Times in seconds; on CUDA they are device times measured with
    events (no synchronisation added), elsewhere host times.

    Attributes:
        batch: number of rows.
        rounds: verify rounds (one draft tree per row and one target forward each).
        forwards: target forwards: the prefill, then one per round.
        emitted: per row, tokens output (the prefill's first token included).
        row_rounds: per row, the rounds in which it was still generating.
        produced: tokens the rounds output, all rows (``sum(emitted) - batch``).
        cut: tokens the rounds produced past a row's budget or stop token, not output.
        accept_lengths: per round, per row, the tokens the round produced for it (accepted
            draft tokens + the target's next token, before any cut); 0 for a finished row.
        prefill_s: the prompt's target forward and the first token.
        draft_s, verify_s, accept_s: the rounds' steps (accept: acceptance, cache
            compaction, the result's read and bookkeeping; with CUDA graphs, the eager warm-up
            round before a capture counts as drafting).
        setup_s: buffers allocated for a new shape (0 when reused).
        capture_s: CUDA-graph capture (0 when the graphs were already captured, or off).
        total_s: the whole call, from its start to its last token (time spent by the
            caller between streamed chunks excluded).
        cuda_graphs: whether the rounds were replayed from CUDA graphs.
    """

    batch: int = 1
    rounds: int = 0
    forwards: int = 0
    emitted: List[int] = field(default_factory=list)
    row_rounds: List[int] = field(default_factory=list)
    produced: int = 0
    cut: int = 0
    accept_lengths: List[List[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    setup_s: float = 0.0
    capture_s: float = 0.0
    total_s: float = 0.0
    cuda_graphs: bool = False

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        """Tokens output per row per round (accepted draft tokens + the target's token), over
        all rows; None when no round ran (the prefill's token alone ended every row)."""
        row_rounds = sum(self.row_rounds)
        return self.produced / row_rounds if row_rounds else None

    def row_acceptance_length(self, row: int) -> Optional[float]:
        """:attr:`mean_acceptance_length` of one row."""
        if not 0 <= row < self.batch:
            raise IndexError(f"row must be in [0, {self.batch}), got {row}")
        return (self.emitted[row] - 1) / self.row_rounds[row] if self.row_rounds[row] else None


@dataclass
class Chunk:
    """One step of :func:`stream`: the prefill (first chunk) or one round.

    Attributes:
        tokens: per row, the tokens this step output (empty for a row that has finished).
        done: per row, whether it has finished (budget met or a stop token output).
        stats: the generation's statistics so far (the same object in every chunk).
    """

    tokens: List[List[int]]
    done: List[bool]
    stats: Stats


@dataclass
class GenerateOutput:
    """The result of :func:`generate`.

    Attributes:
        tokens: int64 ``[B, max(lengths)]`` on the CPU, the new tokens of each row (the
            prompt not included), padded with -1 after ``lengths[b]``.
        lengths: int64 ``[B]``: new tokens of each row (stop token included).
        stats: :class:`Stats`.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    stats: Stats

    def tolist(self) -> List[List[int]]:
        """The new tokens of each row, as lists of ints."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]
