"""A depth-limited suffix trie with counts: every substring (up to `depth` tokens) of the sequences put
in, and how often each occurs. From a pattern (the end of a request's context) it finds the longest
suffix it has seen and follows the most frequent continuation: that is the draft.

Sequences grow token by token (a request's output) without re-inserting anything: the trie keeps, per
sequence, the nodes of the suffixes that end at its last token and extends each by the new token.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        # Per open sequence: nodes of its suffixes of length 1..depth-1 that end at its last token.
        self._ends: dict[object, list[_Node]] = {}

    def extend(self, key: object, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `key` (a new key starts a sequence)."""
        ends = self._ends.get(key, [])
        for t in tokens:
            nxt = []
            for node in [self.root, *ends]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                nxt.append(child)
            ends = nxt[: self.depth - 1]  # a suffix of `depth` tokens grows no further
        self._ends[key] = ends

    def close(self, key: object) -> None:
        """The sequence gets no more tokens: forget its open ends (its counts stay)."""
        self._ends.pop(key, None)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take a whole sequence back out (undoing extend over the same tokens), pruning empty nodes."""
        for start in range(len(tokens)):
            path = [self.root]
            for t in tokens[start : start + self.depth]:
                path.append(path[-1].children[t])
            for parent, child, t in zip(
                reversed(path[:-1]), reversed(path[1:]), reversed(tokens[start : start + self.depth]),
                strict=True,
            ):  # fmt: skip
                child.count -= 1
                if child.count == 0:
                    del parent.children[t]

    def match(self, pattern: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `pattern` (at most depth - 1 tokens) that occurs in the trie
        with something after it, and its length; (None, 0) when there is none. (A request's own trie
        holds its context, so its current suffix always occurs, without a follower the first time.)"""
        n = min(len(pattern), self.depth - 1)
        for length in range(n, 0, -1):
            node = self.root
            for t in pattern[len(pattern) - length :]:
                node = node.children.get(t)
                if node is None:
                    break
            else:
                if node.children:
                    return node, length
        return None, 0

    @staticmethod
    def continue_from(node: _Node, k: int, min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent child while its share of the path so far stays >= min_prob.
        Returns the tokens and a score: the sum of the path probabilities (expected accepted tokens)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < k and node.children:
            t, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / max(node.count, sum(c.count for c in node.children.values()))
            if prob < min_prob:
                break
            draft.append(t)
            score += prob
            node = child
        return draft, score
