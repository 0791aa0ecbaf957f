"""Verification of a draft tree against the target's logits: greedy and exact sampling."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .draft import DraftTree


# ----------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------

def _check_target_logits(tree: DraftTree, target_logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    if not isinstance(target_logits, torch.Tensor):
        raise TypeError(f"target_logits must be a tensor, got {type(target_logits).__name__}")
    if target_logits.dim() == 3 and target_logits.shape[0] == 1:
        target_logits = target_logits[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tree):
        raise ValueError(
            f"target_logits must be [T={len(tree)}, V] (or [1, T, V]), got {tuple(target_logits.shape)}"
        )
    if not target_logits.is_floating_point():
        raise TypeError(f"target_logits must be floating point, got {target_logits.dtype}")
    return target_logits


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Greedy acceptance: the longest root-to-leaf prefix whose every token equals the
    target's argmax at its parent, plus the bonus token (the argmax at the last accepted
    node).

    Args:
        tree: the verified draft tree (T nodes).
        target_logits: ``[T, V]``, the target's logits at every tree node.

    Returns:
        ``(accepted, bonus_token)``: int64 ``[n]`` node indices from the root down (the
        root included, so n >= 1), and the next token as a Python int. Among equally long
        accepted paths the first in ``tree.retrieve`` wins.
    """
    target_logits = _check_target_logits(tree, target_logits)
    best = target_logits.argmax(-1)  # [T]
    paths = tree.retrieve.to(best.device)  # [L, D + 1]
    child, parent = paths[:, 1:], paths[:, :-1]
    matches = (child >= 0) & (tree.tokens.to(best.device)[child.clamp(min=0)] == best[parent.clamp(min=0)])
    accepted_len = matches.to(torch.int64).cumprod(-1).sum(-1)  # draft tokens accepted per path
    path = accepted_len.argmax()
    last_node = paths[path, accepted_len[path]]
    n, bonus = torch.stack([accepted_len[path], best[last_node]]).tolist()  # one host read
    return paths[path, : n + 1], bonus


def sampling_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """The sampling distribution over the last dim, float32: logits / temperature, then
    top-k (keep tokens whose logit reaches the k-th largest), then top-p (keep the
    smallest set of most likely tokens whose mass reaches ``top_p``; the most likely
    token always stays), then softmax. The order matches transformers' ``generate``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for a sampling distribution, got {temperature}")
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores.softmax(-1)


def _check_sampling_args(temperature, top_p, top_k) -> None:
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")


def verify_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, int]:
    """Lossless verification for sampling: EAGLE's recursive rejection sampling over
    siblings, with a deterministic (top-k) draft.

    From the root down: let p be the target's sampling distribution at the current node
    (``sampling_probs`` of its logits). Its children are tried in node order, each
    distinct token x once: accept x with probability p(x); on rejection set p(x) = 0,
    renormalise and try the next sibling. On acceptance move to that child and repeat;
    when every child is rejected (or the node is a leaf), the next token is drawn from
    what is left of p. The emitted tokens (accepted tokens then the next token) are
    distributed exactly as sampling the target token by token.

    The sibling trials of one node are evaluated at once: with q the target mass of the
    distinct children in order, trying child j happens after rejecting the earlier ones,
    which leaves mass ``q_j + q_{j+1} + ... + rest``, so child j is accepted with
    probability ``q_j / (q_j + ... + rest)``; the first success wins. One host read per
    tree level decides where to go.

    Args:
        tree: the verified draft tree (T nodes).
        target_logits: ``[T, V]``.
        temperature: 0 means greedy (``verify_greedy``).
        top_p, top_k: applied to the target distribution (1.0 / 0 = off).
        generator: a torch.Generator on the logits' device, for reproducible draws.

    Returns:
        ``(accepted, next_token)`` as in ``verify_greedy``.
    """
    _check_sampling_args(temperature, top_p, top_k)
    target_logits = _check_target_logits(tree, target_logits)
    if temperature == 0:
        return verify_greedy(tree, target_logits)
    device = target_logits.device
    vocab = target_logits.shape[-1]
    children = tree.children.to(device)  # [T, C]
    width = children.shape[1]
    kid_tokens = tree.tokens.to(device)[children.clamp(min=0)]
    trials = tree.sibling_trials.to(device)

    node = 0
    accepted = [0]
    while True:
        probs = sampling_probs(target_logits[node], temperature, top_p, top_k)  # [V]
        kids, tokens, trial = children[node], kid_tokens[node], trials[node]
        kid_mass = torch.where(trial, probs[tokens], 0.0)
        # What is left of p outside the children: the residual distribution.
        covered = torch.zeros(vocab, dtype=torch.int32, device=device)
        covered.scatter_add_(0, tokens, trial.to(torch.int32))
        residual = probs.masked_fill(covered > 0, 0.0)
        mass_left = kid_mass.flip(0).cumsum(0).flip(0) + residual.sum()
        accept_prob = torch.where(mass_left > 0, kid_mass / mass_left, 0.0)
        draws = torch.rand(width, device=device, generator=generator)
        success = draws < accept_prob
        chosen = torch.where(success.any(), kids[success.to(torch.int8).argmax()], -1)
        chosen, = chosen.reshape(1).tolist()
        if chosen < 0:
            next_token = torch.multinomial(residual, 1, generator=generator)
            return torch.tensor(accepted, dtype=torch.int64, device=device), int(next_token)
        node = chosen
        accepted.append(node)
