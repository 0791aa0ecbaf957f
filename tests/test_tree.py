"""Tree utilities, EAGLE dynamic drafting, verification and KV-cache compaction.

Every check is against an independent, deliberately plain Python implementation (walks
over parent pointers, explicit enumeration, float64 distributions) or, for the cache,
against a small transformers model running the accepted tokens sequentially.
"""
import math
import random
from collections import Counter

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_tree_attn.hf.compat import cache_kwargs
from torch_tree_attn.hf import compact_kv_cache
from torch_tree_attn.tree import (
    DraftTree,
    ancestor_mask,
    build_dynamic_tree,
    dense_tree_mask,
    leaf_mask,
    node_depths,
    pad_trees,
    position_ids,
    retrieve_indices,
    sampling_probs,
    verify_greedy,
    verify_sampling,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------
# Brute-force references
# ----------------------------------------------------------------------------------------

def random_parents(rng: random.Random, size: int, shape: str = "any") -> list:
    parents = [-1]
    for i in range(1, size):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(0)
        else:
            parents.append(rng.randrange(i))
    return parents


def bf_ancestors(parents: list, i: int) -> list:
    """Node i and its ancestors, root first."""
    chain = []
    while i != -1:
        chain.append(i)
        i = parents[i]
    return chain[::-1]


def bf_leaves(parents: list) -> list:
    return [i for i in range(len(parents)) if i not in parents]


def bf_retrieve(parents: list) -> list:
    paths = [bf_ancestors(parents, leaf) for leaf in bf_leaves(parents)]
    width = max(len(p) for p in paths)
    return [p + [-1] * (width - len(p)) for p in paths]


trees = st.builds(
    lambda size, seed, shape: random_parents(random.Random(seed), size, shape),
    st.integers(1, 40),
    st.integers(0, 2**30),
    st.sampled_from(["any", "any", "chain", "star"]),
)


# ----------------------------------------------------------------------------------------
# Structure
# ----------------------------------------------------------------------------------------

@FAST
@given(trees, st.integers(0, 50))
def test_structure_matches_brute_force(parents, prefix_len):
    T = len(parents)
    p = torch.tensor(parents)
    mask = ancestor_mask(p)
    expected_mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        expected_mask[i, bf_ancestors(parents, i)] = True
    assert torch.equal(mask, expected_mask)

    depths = [len(bf_ancestors(parents, i)) - 1 for i in range(T)]
    assert node_depths(p).tolist() == depths
    assert position_ids(p, prefix_len).tolist() == [[prefix_len + d for d in depths]]
    assert leaf_mask(p).tolist() == [i in bf_leaves(parents) for i in range(T)]
    assert retrieve_indices(p).tolist() == bf_retrieve(parents)

    dense = dense_tree_mask(p, prefix_len)
    assert dense.shape == (1, 1, T, prefix_len + T)
    for i in range(T):
        visible = set(range(prefix_len)) | {prefix_len + j for j in bf_ancestors(parents, i)}
        assert {j for j in range(prefix_len + T) if dense[0, 0, i, j]} == visible


@FAST
@given(st.lists(trees, min_size=1, max_size=4), st.integers(0, 2**30))
def test_batched_trees_match_each_tree(forest, seed):
    parents, valid = pad_trees([torch.tensor(t) for t in forest])
    B, T = parents.shape
    assert T == max(len(t) for t in forest)
    mask_offset = torch.tensor([random.Random(seed + b).randrange(20) for b in range(B)])

    masks, depths, leaves = ancestor_mask(parents), node_depths(parents), leaf_mask(parents)
    positions = position_ids(parents, mask_offset)
    paths = retrieve_indices(parents, valid)
    dense = dense_tree_mask(parents, mask_offset, kv_len=40 + T)
    for b, tree in enumerate(forest):
        n = len(tree)
        assert valid[b].tolist() == [True] * n + [False] * (T - n)
        single = torch.tensor(tree)
        assert torch.equal(masks[b, :n, :n], ancestor_mask(single))
        # Padding nodes are roots of their own: they see only themselves, and nobody sees them.
        assert torch.equal(masks[b, n:], torch.eye(T, dtype=torch.bool)[n:])
        assert not masks[b, :n, n:].any()
        assert torch.equal(depths[b, :n], node_depths(single))
        assert torch.equal(leaves[b, :n], leaf_mask(single))
        assert torch.equal(positions[b, :n], position_ids(single, int(mask_offset[b]))[0])
        expected_paths = torch.tensor(bf_retrieve(tree))
        L, W = expected_paths.shape
        assert torch.equal(paths[b, :L, :W], expected_paths)
        assert (paths[b, L:] == -1).all() and (paths[b, :, W:] == -1).all()
        single_dense = dense_tree_mask(single, int(mask_offset[b]), kv_len=40 + T)
        assert torch.equal(dense[b, :, :n], single_dense[0])


def test_tree_module_does_not_import_transformers():
    """The tree utilities are plain torch: transformers-specific code (cache compaction) lives in
    torch_tree_attn.hf."""
    import subprocess
    import sys

    code = "import sys, torch_tree_attn.tree; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefix_lengths_broadcast():
    p = torch.tensor([-1, 0, 1, 0])
    assert position_ids(p, torch.tensor([3, 10])).tolist() == [[3, 4, 5, 4], [10, 11, 12, 11]]
    batch, _ = pad_trees([p, torch.tensor([-1, 0])])
    assert position_ids(batch, 2).tolist() == [[2, 3, 4, 3], [2, 3, 2, 2]]
    assert torch.equal(dense_tree_mask(batch, 2)[1], dense_tree_mask(batch, torch.tensor([2, 2]))[1])
    with pytest.raises(ValueError, match=r"mask_offset has 3 entries, expected 1 or 2"):
        position_ids(batch, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"mask_offset must be >= 0"):
        dense_tree_mask(p, -1)


@pytest.mark.parametrize(
    "parents, message",
    [
        (torch.tensor([-1, 0, 1], dtype=torch.int32), "int64"),
        (torch.tensor([0, 0, 1]), r"parents\[..., 0\] must be -1"),
        (torch.tensor([-1, 0, 2]), "node 2 has parent 2"),
        (torch.tensor([-1, 3, 0, 0]), "node 1 has parent 3"),
        (torch.tensor([-1, -2]), "node 1 has parent -2"),
        (torch.zeros(0, dtype=torch.int64), "T >= 1"),
        (torch.full((1, 1, 2), -1), r"\[T\] or \[B, T\]"),
    ],
)
def test_bad_parents_are_rejected(parents, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ancestor_mask(parents)


def test_draft_tree_children_table():
    rng = random.Random(5)
    for _ in range(30):
        parents = random_parents(rng, rng.randrange(1, 30))
        tree = DraftTree(torch.zeros(len(parents), dtype=torch.int64), torch.tensor(parents),
                         torch.zeros(len(parents)))
        for i in range(len(parents)):
            kids = [j for j in range(len(parents)) if parents[j] == i]
            row = tree.children[i].tolist()
            assert row[: len(kids)] == kids and all(k == -1 for k in row[len(kids):])


# ----------------------------------------------------------------------------------------
# EAGLE dynamic tree
# ----------------------------------------------------------------------------------------

class PathTable:
    """Synthetic draft: next-token log-probs are a fixed random function of the path of
    tokens from the root. Records every expand call and checks what it is handed."""

    def __init__(self, vocab: int, seed: int, sharpness: float = 2.0):
        self.vocab, self.seed, self.sharpness = vocab, seed, sharpness
        self.expanded_paths = []  # path of every expanded node, in expanded order
        self.calls = []

    def log_probs(self, path: tuple) -> torch.Tensor:
        g = torch.Generator().manual_seed(stable_seed(self.seed, *path))
        return (torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.sharpness).log_softmax(-1)

    def __call__(self, step) -> torch.Tensor:
        n = step.tokens.shape[0]
        first = len(self.expanded_paths)
        assert step.depth == len(self.calls)
        assert step.ancestor_mask.shape == (n, first + n) and step.ancestor_mask.dtype == torch.bool
        assert step.position_offsets.tolist() == [step.depth] * n
        new_paths = []
        for k in range(n):
            parent = int(step.parents_in_tree[k])
            if step.depth == 0:
                assert parent == -1
                path = (int(step.tokens[k]),)
            else:
                assert 0 <= parent < first and len(self.expanded_paths[parent]) == step.depth
                path = self.expanded_paths[parent] + (int(step.tokens[k]),)
            new_paths.append(path)
            # Ancestor-or-self over all expanded nodes, brute force by path prefixes.
            row = [False] * (first + n)
            for j, other in enumerate(self.expanded_paths + new_paths):
                if j < first or j == first + k:
                    row[j] = path[: len(other)] == other
            assert step.ancestor_mask[k].tolist() == row
        self.expanded_paths += new_paths
        self.calls.append(n)
        return torch.stack([self.log_probs(p) for p in new_paths]).float()


def bf_dynamic_tree(root: int, table: PathTable, total_tokens: int, depth: int, top_k: int):
    """EAGLE's procedure, literally and without shortcuts: expand the root, then `depth`
    frontiers of the top_k best new children; keep the best total_tokens - 1 candidates
    (ties by creation order), listed in creation order."""
    candidates = []  # (score, path, parent candidate id)
    frontier = [(0.0, (root,), -1)]
    for level in range(depth + 1):
        new = []
        for score, path, cid in frontier:
            lp = table.log_probs(path).float()
            best = sorted(range(table.vocab), key=lambda v: -float(lp[v]))[:top_k]
            for v in best:
                # float32 sums, as a draft's float32 scores would be accumulated
                child_score = float(torch.tensor(score, dtype=torch.float32) + lp[v])
                new.append((len(candidates) + len(new), child_score, path + (v,), cid))
        candidates += [(s, p, c) for _, s, p, c in new]
        ranked = sorted(new, key=lambda c: (-c[1], c[0]))[:top_k]
        frontier = [(s, p, i) for i, s, p, _ in ranked]
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][0], i))
    kept = sorted(order[: total_tokens - 1])
    position = {cid: k + 1 for k, cid in enumerate(kept)}
    tokens = [root] + [candidates[i][1][-1] for i in kept]
    parents = [-1] + [position.get(candidates[i][2], 0) if candidates[i][2] >= 0 else 0 for i in kept]
    assert all(candidates[i][2] < 0 or candidates[i][2] in position for i in kept), "not parent-closed"
    scores = [0.0] + [candidates[i][0] for i in kept]
    paths = [(root,)] + [candidates[i][1] for i in kept]
    return tokens, parents, scores, paths


@settings(max_examples=40, deadline=None)
@given(
    total_tokens=st.integers(1, 40),
    depth=st.integers(0, 5),
    top_k=st.integers(1, 6),
    vocab=st.integers(2, 12),
    sharpness=st.sampled_from([0.3, 2.0, 6.0]),
    seed=st.integers(0, 2**30),
)
def test_dynamic_tree_matches_eagle_procedure(total_tokens, depth, top_k, vocab, sharpness, seed):
    table = PathTable(vocab, seed, sharpness)
    tree = build_dynamic_tree(7 % vocab, table, total_tokens=total_tokens, depth=depth, top_k=top_k)
    tokens, parents, scores, paths = bf_dynamic_tree(7 % vocab, table, total_tokens, depth, top_k)
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    assert tree.scores.tolist() == scores
    # The tree's paths are the drafted token sequences, and the scores their log-probs.
    for i in range(len(tree)):
        assert tuple(tree.tokens[bf_ancestors(parents, i)].tolist()) == paths[i]
    assert len(table.calls) <= depth + 1 and all(n <= top_k for n in table.calls)


def test_dynamic_tree_defaults_and_early_stop():
    table = PathTable(vocab=50, seed=1, sharpness=3.0)
    tree = build_dynamic_tree(3, table)  # EAGLE's 60 / 7 / 10
    assert len(tree) == 60 and table.calls[0] == 1 and max(table.calls) == 10
    # Here the draft is sure of itself: a few nodes fill the tree and drafting stops.
    peaked = PathTable(vocab=50, seed=2, sharpness=30.0)
    tree = build_dynamic_tree(3, peaked, total_tokens=4, depth=7, top_k=10)
    assert len(tree) == 4 and len(peaked.calls) < 8
    assert peaked.calls[1:] and max(peaked.calls) <= 3  # widths capped at total_tokens - 1
    tokens, parents, _, _ = bf_dynamic_tree(3, peaked, 4, 7, 10)
    assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents


class TiedTable(PathTable):
    """Equal scores everywhere (uniform draft), or children exactly as likely as their
    parents (one token of log-prob 0, the rest -inf)."""

    def __init__(self, kind: str, vocab: int = 6):
        super().__init__(vocab, seed=0)
        self.kind = kind

    def log_probs(self, path: tuple) -> torch.Tensor:
        if self.kind == "uniform":
            return torch.full((self.vocab,), -math.log(self.vocab), dtype=torch.float64)
        lp = torch.full((self.vocab,), -math.inf, dtype=torch.float64)
        lp[len(path) % self.vocab] = 0.0
        return lp


@pytest.mark.parametrize("kind", ["uniform", "certain"])
def test_dynamic_tree_ties_keep_parents(kind):
    """With ties the token chosen among equal log-probs is arbitrary, but the shape and
    scores are not: ranking ties by creation order keeps every kept node's parent."""
    table = TiedTable(kind)
    tree = build_dynamic_tree(0, table, total_tokens=20, depth=4, top_k=3)
    _, parents, scores, _ = bf_dynamic_tree(0, TiedTable(kind), 20, 4, 3)
    assert tree.parents.tolist() == parents
    assert tree.scores.tolist() == pytest.approx(scores)


def test_dynamic_tree_rejects_bad_expand_output():
    with pytest.raises(ValueError, match=r"log-probs \[n=1, V\]"):
        build_dynamic_tree(0, lambda step: torch.zeros(2, 5))
    with pytest.raises(ValueError, match="parent was not kept"):
        # Positive "log-probs" let a child outscore its parent.
        build_dynamic_tree(0, lambda step: torch.arange(4.0).expand(step.tokens.shape[0], 4),
                           total_tokens=4, depth=3, top_k=2)
    with pytest.raises(ValueError, match="top_k must be"):
        build_dynamic_tree(0, lambda step: None, top_k=0)


# ----------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------

def random_tree(rng: random.Random, size: int, vocab: int, distinct_siblings: bool) -> DraftTree:
    parents = random_parents(rng, size)
    tokens = [rng.randrange(vocab)]
    for i in range(1, size):
        taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        choices = [v for v in range(vocab) if not (distinct_siblings and v in taken)]
        tokens.append(rng.choice(choices) if choices else rng.randrange(vocab))
        if distinct_siblings and not choices:  # no distinct token left: make it a chain
            parents[i] = i - 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.zeros(size))


def bf_greedy(tree: DraftTree, logits: torch.Tensor):
    """Longest root-to-leaf path accepted token by token; first such path wins."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    best = logits.argmax(-1).tolist()
    winner = [0]
    for leaf in bf_leaves(parents):
        path = bf_ancestors(parents, leaf)
        k = 1
        while k < len(path) and tokens[path[k]] == best[path[k - 1]]:
            k += 1
        if k > len(winner):
            winner = path[:k]
    return winner, best[winner[-1]]


def bf_greedy_walk(tree: DraftTree, logits: torch.Tensor):
    """Walk down: move to the child holding the target's argmax while there is one."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        want = int(logits[node].argmax())
        kids = [j for j in range(len(parents)) if parents[j] == node and tokens[j] == want]
        if not kids:
            return path, want
        node = kids[0]
        path.append(node)


@pytest.mark.parametrize("distinct", [True, False])
def test_verify_greedy_matches_brute_force(distinct):
    rng = random.Random(11)
    for trial in range(150):
        vocab = rng.choice([2, 3, 5])
        tree = random_tree(rng, rng.randrange(1, 25), vocab, distinct)
        logits = torch.randn(len(tree), vocab, generator=torch.Generator().manual_seed(trial))
        accepted, bonus = verify_greedy(tree, logits)
        expected, expected_bonus = bf_greedy(tree, logits)
        assert accepted.tolist() == expected and bonus == expected_bonus
        if distinct:
            assert (expected, expected_bonus) == bf_greedy_walk(tree, logits)
        # temperature 0 is greedy
        assert verify_sampling(tree, logits, temperature=0.0)[0].tolist() == expected


def test_verify_rejects_bad_arguments():
    tree = DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.zeros(2))
    with pytest.raises(ValueError, match=r"target_logits must be \[T=2, V\]"):
        verify_greedy(tree, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="top_p"):
        verify_sampling(tree, torch.zeros(2, 4), top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        verify_sampling(tree, torch.zeros(2, 4), temperature=-1.0)
    with pytest.raises(ValueError, match=r"DraftTree.tokens must have the shape of parents \(2,\)"):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0]), torch.zeros(2))
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.zeros(2))


def bf_sampling_probs(logits, temperature, top_p, top_k) -> list:
    """float64, one token at a time: temperature, top-k (ties at the k-th kept), top-p."""
    scores = [float(x) / temperature for x in logits]
    keep = set(range(len(scores)))
    if 0 < top_k < len(scores):
        kth = sorted(scores, reverse=True)[top_k - 1]
        keep = {v for v in keep if scores[v] >= kth}
    def normalised(kept):
        z = sum(math.exp(scores[v]) for v in kept)
        return {v: math.exp(scores[v]) / z for v in kept}
    if top_p < 1:
        probs = normalised(keep)
        kept, mass = set(), 0.0
        for v in sorted(keep, key=lambda v: -probs[v]):
            if mass >= top_p:
                break
            kept.add(v)
            mass += probs[v]
        keep = kept
    probs = normalised(keep)
    return [probs.get(v, 0.0) for v in range(len(scores))]


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.6, 1.0, 0), (1.3, 0.8, 0), (0.9, 0.9, 3), (1.0, 1.0, 2)])
def test_sampling_probs_match_brute_force(temperature, top_p, top_k):
    logits = torch.randn(50, 9, generator=torch.Generator().manual_seed(0)) * 2
    got = sampling_probs(logits, temperature, top_p, top_k)
    for row in range(50):
        want = bf_sampling_probs(logits[row].tolist(), temperature, top_p, top_k)
        torch.testing.assert_close(got[row].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-5)


def stable_seed(*values: int) -> int:
    # Python's hash() of ints is stable across runs, but spell the mixing out anyway.
    seed = 1469598103934665603
    for v in values:
        seed = ((seed ^ (v + 7)) * 1099511628211) % (2**61 - 1)
    return seed % (2**31)


# The target is a small language model over 5 tokens whose next-token logits are a fixed
# random function of the whole context (root token, then the drafted tokens).
VOCAB = 5
ROOT = 0


def context_logits(context: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(stable_seed(99, *context))
    return torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5


def target_aligned_tree(ranks=((0, 2, 3), (0, 2), (1, 0))):
    """A tree like a decent draft's: the children of a node at depth d hold the target's
    next tokens of the given likelihood ranks at temperature 1 (rank 0 = most likely), so
    acceptance reaches every depth, while the skipped ranks keep rejections frequent even
    under top-k."""
    tokens, parents, contexts = [ROOT], [-1], [(ROOT,)]
    frontier = [0]
    for level_ranks in ranks:
        next_frontier = []
        for node in frontier:
            order = context_logits(contexts[node]).argsort(descending=True).tolist()
            for rank in level_ranks:
                tokens.append(order[rank])
                parents.append(node)
                contexts.append(contexts[node] + (order[rank],))
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return tokens, parents


def tree_logits(tokens, parents) -> torch.Tensor:
    return torch.stack([
        context_logits(tuple(tokens[j] for j in bf_ancestors(parents, i))) for i in range(len(tokens))
    ]).float()


def chi_square(counts: Counter, expected: dict, trials: int) -> float:
    stat = 0.0
    for cell, p in expected.items():
        if p == 0:
            assert counts[cell] == 0, f"{cell} has probability 0 but was emitted {counts[cell]} times"
        else:
            stat += (counts[cell] - trials * p) ** 2 / (trials * p)
    assert set(counts) <= set(expected)
    return stat


def chi_square_bound(cells: int) -> float:
    # Mean + 6 standard deviations of a chi-square with cells - 1 degrees of freedom:
    # a correct sampler exceeds it with probability well under 1e-4.
    dof = cells - 1
    return dof + 6 * math.sqrt(2 * dof)


@pytest.mark.parametrize(
    "temperature, top_p, top_k, duplicate",
    [(1.0, 1.0, 0, False), (0.7, 1.0, 3, False), (1.4, 0.8, 0, False), (0.8, 0.9, 2, True)],
)
def test_verify_sampling_reproduces_target_distribution(temperature, top_p, top_k, duplicate):
    tokens, parents = target_aligned_tree()
    if duplicate:  # a repeated sibling token must be tried only once
        tokens.append(tokens[1])
        parents.append(0)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.zeros(len(tokens)))
    logits = tree_logits(tokens, parents)
    generator = torch.Generator().manual_seed(1234)
    root = tokens[0]
    follow_up_trees = {}

    def dist(context):
        return bf_sampling_probs(context_logits(context).tolist(), temperature, top_p, top_k)

    trials = 3000
    first, joint, lengths = Counter(), Counter(), Counter()
    for _ in range(trials):
        accepted, next_token = verify_sampling(tree, logits, temperature, top_p, top_k, generator=generator)
        path = accepted.tolist()
        assert path[0] == 0 and all(parents[b] == a for a, b in zip(path, path[1:]))
        emitted = [tokens[i] for i in path[1:]] + [next_token]
        lengths[len(emitted)] += 1
        if len(emitted) == 1:
            # The next decoding step would verify a new tree rooted at the emitted token.
            y = emitted[0]
            if y not in follow_up_trees:
                sub_tokens, sub_parents = [y, 2, 0, 1], [-1, 0, 0, 2]
                sub = DraftTree(torch.tensor(sub_tokens), torch.tensor(sub_parents), torch.zeros(4))
                contexts = [(root,) + tuple(sub_tokens[j] for j in bf_ancestors(sub_parents, i)) for i in range(4)]
                follow_up_trees[y] = (sub, torch.stack([context_logits(c) for c in contexts]).float())
            sub, sub_logits = follow_up_trees[y]
            sub_path, sub_next = verify_sampling(sub, sub_logits, temperature, top_p, top_k, generator=generator)
            emitted.append(int(sub.tokens[sub_path[1]]) if len(sub_path) > 1 else sub_next)
        first[emitted[0]] += 1
        joint[tuple(emitted[:2])] += 1

    p_first = dist((root,))
    expected_first = {v: p_first[v] for v in range(VOCAB)}
    expected_joint = {}
    for a in range(VOCAB):
        p_second = dist((root, a))
        for b in range(VOCAB):
            expected_joint[(a, b)] = p_first[a] * p_second[b]
    stat_first = chi_square(first, expected_first, trials)
    stat_joint = chi_square(joint, expected_joint, trials)
    assert stat_first < chi_square_bound(VOCAB), (stat_first, first, expected_first)
    cells = sum(p > 0 for p in expected_joint.values())
    assert stat_joint < chi_square_bound(cells), (stat_joint, joint)
    # Acceptance stopped at several depths, and often ran through to a leaf.
    assert len(lengths) >= 3 and lengths[4] >= 30, lengths

    # The same counts are far from a plainly different distribution, so the test has power.
    plain = bf_sampling_probs(context_logits((root,)).tolist(), 1.0, 1.0, 0)
    shifted = {v: 0.5 * plain[v] + 0.5 * expected_first[v] for v in range(VOCAB)}
    if max(abs(shifted[v] - expected_first[v]) for v in range(VOCAB)) > 0.03:
        assert chi_square(first, shifted, trials) > chi_square_bound(VOCAB)


def test_verify_sampling_is_reproducible_with_a_generator():
    tokens, parents = target_aligned_tree()
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.zeros(len(tokens)))
    logits = tree_logits(tokens, parents)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        runs.append([(a.tolist(), t) for a, t in (verify_sampling(tree, logits, generator=g) for _ in range(20))])
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------------------
# KV-cache compaction with a real (tiny, random) transformers model
# ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).eval()


def make_cache(kind, model, capacity=40):
    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    return transformers.StaticCache(config=model.config, max_cache_len=capacity)


def additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("accepted", [[0], [0, 1, 3, 5, 7], [0, 2, 6]])
@torch.no_grad()
def test_compacted_cache_continues_like_sequential_decoding(tiny_llama, kind, attn, accepted):
    model = tiny_llama
    model.set_attn_implementation(attn)
    g = torch.Generator().manual_seed(3)
    prefix_len = 6
    prefix = torch.randint(0, 64, (1, prefix_len), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 2, 5])
    tokens = torch.randint(0, 64, (8,), generator=g)
    cache = make_cache(kind, model)
    model(input_ids=prefix, use_cache=True, **cache_kwargs(model, cache))
    kv_len = prefix_len + len(parents) if kind == "dynamic" else 40
    model(input_ids=tokens[None], position_ids=position_ids(parents, prefix_len),
          attention_mask=additive(dense_tree_mask(parents, prefix_len, kv_len)), use_cache=True,
          **cache_kwargs(model, cache))

    accepted = torch.tensor(accepted)
    new_len = compact_kv_cache(cache, prefix_len, accepted)
    assert new_len == prefix_len + len(accepted) == int(cache.get_seq_length())
    # Two more steps on the compacted cache, one token each, then two at once.
    follow = torch.randint(0, 64, (4,), generator=g)
    got = [model(input_ids=follow[None, :1], use_cache=True, **cache_kwargs(model, cache)).logits[0, -1],
           model(input_ids=follow[None, 1:2], use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]]
    got.append(model(input_ids=follow[None, 2:], use_cache=True, **cache_kwargs(model, cache)).logits[0])
    assert int(cache.get_seq_length()) == new_len + 4

    sequence = torch.cat([prefix[0], tokens[accepted], follow])[None]
    reference = model(input_ids=sequence).logits[0, new_len:]
    torch.testing.assert_close(torch.stack(got[:2]), reference[:2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], reference[2:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_compaction_with_one_path_per_batch_row(tiny_llama):
    model = tiny_llama
    model.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(4)
    prefix_len = 4
    prefix = torch.randint(0, 64, (2, prefix_len), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2])
    tokens = torch.randint(0, 64, (2, 5), generator=g)
    cache = make_cache("dynamic", model)
    model(input_ids=prefix, use_cache=True, **cache_kwargs(model, cache))
    model(input_ids=tokens, position_ids=position_ids(parents, prefix_len).expand(2, -1),
          attention_mask=additive(dense_tree_mask(parents, prefix_len)).expand(2, -1, -1, -1),
          use_cache=True, **cache_kwargs(model, cache))
    accepted = torch.tensor([[0, 1, 3], [0, 2, 4]])
    assert compact_kv_cache(cache, prefix_len, accepted) == prefix_len + 3
    follow = torch.randint(0, 64, (2, 1), generator=g)
    got = model(input_ids=follow, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
    for b in range(2):
        sequence = torch.cat([prefix[b], tokens[b, accepted[b]], follow[b]])[None]
        torch.testing.assert_close(got[b], model(input_ids=sequence).logits[0, -1], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_sliding_qwen3():
    """Layer 0 full attention, layer 1 a sliding window of 16."""
    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_sliding_window=True,
        sliding_window=16, max_window_layers=1,
    )
    config._attn_implementation = "eager"
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@torch.no_grad()
def test_compaction_of_sliding_window_layers_before_they_slide(tiny_sliding_qwen3, kind):
    model = tiny_sliding_qwen3
    g = torch.Generator().manual_seed(5)
    prefix_len, parents = 4, torch.tensor([-1, 0, 0, 1, 2, 3, 2, 5])
    prefix = torch.randint(0, 64, (1, prefix_len), generator=g)
    tokens = torch.randint(0, 64, (8,), generator=g)
    cache = make_cache(kind, model, capacity=32)  # the sliding layer keeps 16 of them
    assert "SlidingWindow" in type(cache.layers[1]).__name__
    model(input_ids=prefix, use_cache=True, **cache_kwargs(model, cache))
    # One mask per layer type, as wide as that layer's keys.
    full_len, sliding_len = (prefix_len + 8, prefix_len + 8) if kind == "dynamic" else (32, 16)
    masks = {
        "full_attention": additive(dense_tree_mask(parents, prefix_len, full_len)),
        "sliding_attention": additive(dense_tree_mask(parents, prefix_len, sliding_len)),
    }
    model(input_ids=tokens[None], position_ids=position_ids(parents, prefix_len),
          attention_mask=masks, use_cache=True, **cache_kwargs(model, cache))
    accepted = torch.tensor([0, 2, 6])
    assert compact_kv_cache(cache, prefix_len, accepted) == prefix_len + 3 == int(cache.get_seq_length())
    follow = torch.randint(0, 64, (1, 3), generator=g)
    got = model(input_ids=follow, use_cache=True, **cache_kwargs(model, cache)).logits[0]
    reference = model(input_ids=torch.cat([prefix[0], tokens[accepted], follow[0]])[None]).logits[0, -3:]
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)

    # Once the window has slid, the keys compaction would move are gone: refuse.
    model(input_ids=torch.randint(0, 64, (1, 12), generator=g), use_cache=True, **cache_kwargs(model, cache))
    with pytest.raises(NotImplementedError, match="SlidingWindowLayer"):
        compact_kv_cache(cache, int(cache.get_seq_length()) - 2, torch.tensor([0, 1]))


def test_compaction_rejects_bad_arguments(tiny_llama):
    model = tiny_llama
    cache = make_cache("dynamic", model)
    with pytest.raises(ValueError, match="no initialized layer"):
        compact_kv_cache(cache, 0, torch.tensor([0]))
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 5, dtype=torch.long), use_cache=True, **cache_kwargs(model, cache))
    with pytest.raises(ValueError, match=r"tree slots \[0, 3\)"):
        compact_kv_cache(cache, 2, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="non-empty int tensor"):
        compact_kv_cache(cache, 2, torch.tensor([], dtype=torch.int64))
    with pytest.raises(TypeError, match="transformers Cache"):
        compact_kv_cache(object(), 2, torch.tensor([0]))

    class QuantizedLikeLayer(transformers.cache_utils.DynamicLayer):
        pass  # a subclass may keep state beyond keys/values: refused, not half-moved

    cache.layers[1].__class__ = QuantizedLikeLayer
    with pytest.raises(TypeError, match="got a QuantizedLikeLayer layer"):
        compact_kv_cache(cache, 2, torch.tensor([0, 1]))


# ----------------------------------------------------------------------------------------
# Accelerators: the same code on the device of the tensors (skipped where there is none)
# ----------------------------------------------------------------------------------------

ACCELERATORS = (["cuda"] if torch.cuda.is_available() else []) + (
    ["mps"] if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available() else []
)
on_accelerators = pytest.mark.parametrize(
    "device", ACCELERATORS or [pytest.param("none", marks=pytest.mark.skip(reason="no cuda or mps device"))]
)


class DevicePathTable(PathTable):
    def __init__(self, device, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = device

    def __call__(self, step):
        assert step.depth == 0 or step.tokens.device.type == self.device
        cpu_step = type(step)(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(step).items()})
        return super().__call__(cpu_step).to(self.device)


@on_accelerators
def test_tree_structure_build_and_verify_on_accelerator(device):
    rng = random.Random(21)
    forest = [torch.tensor(random_parents(rng, rng.randrange(1, 30))) for _ in range(3)]
    parents, valid = pad_trees(forest)
    on_device = parents.to(device)
    assert torch.equal(ancestor_mask(on_device).cpu(), ancestor_mask(parents))
    assert torch.equal(position_ids(on_device, torch.tensor([1, 2, 3], device=device)).cpu(),
                       position_ids(parents, torch.tensor([1, 2, 3])))
    assert torch.equal(retrieve_indices(on_device, valid.to(device)).cpu(), retrieve_indices(parents, valid))
    assert torch.equal(dense_tree_mask(on_device, 5).cpu(), dense_tree_mask(parents, 5))

    tree = build_dynamic_tree(3, DevicePathTable(device, 40, seed=8), total_tokens=30, depth=5, top_k=6)
    expected = build_dynamic_tree(3, PathTable(40, seed=8), total_tokens=30, depth=5, top_k=6)
    assert tree.tokens.device.type == device
    assert torch.equal(tree.tokens.cpu(), expected.tokens) and torch.equal(tree.parents.cpu(), expected.parents)

    logits = torch.randn(len(tree), 40, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(1, len(tree)), tree.tokens[1:].cpu()] += 4  # make acceptance likely
    accepted, bonus = verify_greedy(tree, logits.to(device))
    expected_accepted, expected_bonus = verify_greedy(expected, logits)
    assert accepted.tolist() == expected_accepted.tolist() and bonus == expected_bonus


@on_accelerators
def test_verify_sampling_distribution_on_accelerator(device):
    tokens, parents = target_aligned_tree()
    tree = DraftTree(torch.tensor(tokens, device=device), torch.tensor(parents, device=device),
                     torch.zeros(len(tokens), device=device))
    logits = tree_logits(tokens, parents).to(device)
    generator = torch.Generator(device=device).manual_seed(3)
    trials, first = 2000, Counter()
    for _ in range(trials):
        accepted, next_token = verify_sampling(tree, logits, 0.9, 0.95, 0, generator=generator)
        first[tokens[int(accepted[1])] if len(accepted) > 1 else next_token] += 1
    p_first = bf_sampling_probs(context_logits((ROOT,)).tolist(), 0.9, 0.95, 0)
    stat = chi_square(first, dict(enumerate(p_first)), trials)
    assert stat < chi_square_bound(VOCAB), (stat, first, p_first)


@on_accelerators
@pytest.mark.parametrize("kind", ["dynamic", "static"])
@torch.no_grad()
def test_compaction_on_accelerator(tiny_llama, device, kind):
    model = tiny_llama.to(device)
    model.set_attn_implementation("sdpa")
    try:
        g = torch.Generator().manual_seed(6)
        prefix_len, parents = 5, torch.tensor([-1, 0, 0, 1, 2, 3, 2, 5])
        prefix = torch.randint(0, 64, (1, prefix_len), generator=g).to(device)
        tokens = torch.randint(0, 64, (8,), generator=g).to(device)
        cache = make_cache(kind, model)
        model(input_ids=prefix, use_cache=True, **cache_kwargs(model, cache))
        kv_len = prefix_len + 8 if kind == "dynamic" else 40
        mask = additive(dense_tree_mask(parents, prefix_len, kv_len)).to(device)
        model(input_ids=tokens[None], position_ids=position_ids(parents, prefix_len).to(device),
              attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
        accepted = torch.tensor([0, 2, 6], device=device)
        assert compact_kv_cache(cache, prefix_len, accepted) == prefix_len + 3
        assert cache.layers[0].keys.device.type == device
        follow = torch.randint(0, 64, (1, 3), generator=g).to(device)
        got = model(input_ids=follow, use_cache=True, **cache_kwargs(model, cache)).logits[0]
        reference = model(input_ids=torch.cat([prefix[0], tokens[accepted], follow[0]])[None]).logits[0, -3:]
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    finally:
        model.to("cpu")
