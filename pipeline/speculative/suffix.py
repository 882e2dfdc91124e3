"""Suffix drafting (SuffixDecoding, arXiv 2411.04975) for agent traffic, model-free.

Agents repeat themselves: the same tool call with other arguments, a file they read two turns ago,
the plan they wrote at the top. Prompt lookup (`ngram`) only sees the request's own context and
takes the first match; suffix drafting counts every continuation it has seen, in the request's
context and in the responses of recent requests, and drafts the likeliest path.

The structure is a suffix tree truncated at depth `max_depth`, built online, one token at a time,
over several sequences: `count(s)` of a node is how many times the string `s` (at most
`max_depth` tokens) occurs in them. Edges are compressed (a node holds a run of tokens read from
one of the sequences), so the tree has at most about two nodes per token whatever `max_depth` is.

A proposal, with the same semantics as vLLM's `method="suffix"` (which needs Arctic Inference,
not installable here): for each match length m = 1, 2, ... (the context's last m tokens, while
they occur in the tree and m < `max_depth`), walk down from the match, taking the most frequent
child at each branch; the path's probability is the product of count(child) / count(node) over
its branches; stop at `min(k, m * max_spec_factor)` tokens or when the probability falls under
`min_token_prob`. The score of a draft is the sum of its tokens' probabilities; the best score
over all m wins (on a tie, the longer match), and so does the better of the request's own tree
and the recent responses' trees.

Where this differs from Arctic Inference's C++ cache (the algorithm is the same, the code is not
its code):

- Drafting past assumed tokens (the service's prefetch) matches them without putting them in a
  tree; a truncation of the request's context (a resend from the proposer, rare) rebuilds the
  request's own tree and stops caching its response.
- Recent responses live in two trees, not one with removal: new responses go into the current
  tree; once it holds `max_cached_requests / 2` of them, the older tree is dropped whole and the
  current one becomes the older. So between half of and all of the last `max_cached_requests`
  responses are cached, and forgetting costs nothing. A request still running when its tree is
  dropped moves its response so far into the current tree.

Example:
    >>> drafter = SuffixDrafter(SuffixSettings(max_depth=8))
    >>> first = drafter.new_state("turn-1")
    >>> first.append([1, 2])                    # the prompt
    >>> first.append([10, 11, 12, 13])          # its response, cached for other requests
    >>> second = drafter.new_state("turn-2")
    >>> second.append([3, 4, 10, 11])           # another prompt that reaches the same text
    >>> second.propose(num_speculative_tokens=3)
    [12, 13]
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt
from pydantic.dataclasses import dataclass as pydantic_dataclass


# A pydantic dataclass: the app config validates `draft.suffix` as this class. Names and defaults
# follow vLLM's `suffix_decoding_*` speculative settings, but for max_cached_requests (vLLM:
# 10,000), whose trees live in a Python process here.
@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class SuffixSettings:
    """The `suffix` drafter's settings (vLLM's `suffix_decoding_*`)."""

    max_depth: PositiveInt = Field(24, ge=2, description=(
        "Depth of the suffix trees: the longest match plus its drafts, in tokens."))
    max_spec_factor: PositiveFloat = Field(1.0, description=(
        "Draft at most this many tokens per matched token (and at most num_speculative_tokens)."))
    min_token_prob: float = Field(0.1, ge=0, le=1, description=(
        "Draft a token only while the path's estimated probability (from the counts) is at "
        "least this."))
    max_cached_requests: NonNegativeInt = Field(1000, description=(
        "Recent responses the drafter keeps to draft from for other requests (between half of "
        "and all of them; 0: each request drafts from its own context only)."))


class _Node:
    """A run of `length` tokens, `seqs[seq][start:start + length]`, below `parent`."""

    __slots__ = ("children", "count", "seq", "start", "length", "parent")

    def __init__(self, seq: int, start: int, length: int, count: int, parent: _Node | None):
        self.children: dict[int, _Node] = {}
        self.count = count
        self.seq = seq
        self.start = start
        self.length = length
        self.parent = parent


class SuffixTree:
    """Every substring of at most `max_depth` tokens of the sequences appended, with counts.

    Each sequence keeps its last `max_depth` suffixes open (the nodes they end at); appending a
    token extends each of them by one edge step, so an append costs O(max_depth).

    Example:
        >>> tree = SuffixTree(max_depth=4)
        >>> tree.extend(0, [1, 2, 3, 1, 2, 4])
        >>> tree.count([1, 2]), tree.count([2, 3]), tree.count([5])
        (2, 1, 0)
        >>> tree.speculate([9, 1, 2], max_spec_tokens=2, max_spec_factor=1.0,
        ...                min_token_prob=0.1)   # [1, 2] goes on with 3 or 4 (0.5 each), then 1
        ([3, 1], 1.0)
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(-1, 0, 0, 0, None)
        self.seqs: dict[int, list[int]] = {}
        self._open: dict[int, list[_Node]] = {}  # per sequence, the nodes its open suffixes end at

    def extend(self, seq: int, token_ids: Sequence[int]) -> None:
        """Append `token_ids` to sequence `seq` (a new one when unseen)."""
        tokens = self.seqs.setdefault(seq, [])
        open_ = self._open.setdefault(seq, [])
        for token in token_ids:
            token = int(token)
            tokens.append(token)
            open_.append(self.root)
            self.root.count += 1
            if len(open_) > self.max_depth:
                del open_[0]  # that suffix is max_depth tokens long: it ends where it is
            for i, node in enumerate(open_):  # longest first
                open_[i] = self._step(node, seq, len(tokens) - 1, token)

    def _token(self, node: _Node, offset: int = 0) -> int:
        return self.seqs[node.seq][node.start + offset]

    def _step(self, node: _Node, seq: int, pos: int, token: int) -> _Node:
        """Extend the suffix that ends at `node` by `token` (at `seqs[seq][pos]`); returns the
        node it now ends at. Invariant: every suffix ends at the end of a node's run."""
        child = node.children.get(token)
        if child is None:
            if node.count == 1 and node is not self.root:
                node.length += 1  # a leaf only this suffix reaches: its run goes on in `seq`
                return node
            leaf = _Node(seq, pos, 1, 1, node)
            node.children[token] = leaf
            return leaf
        if node.count == child.count + 1 and node is not self.root:
            # Every other suffix through `node` goes on into `child`; once this one does too,
            # the two have one count: fuse node's run with child's first token.
            if child.length == 1:
                parent = node.parent
                parent.children[self._token(node)] = child
                child.parent = parent
                child.seq, child.start, child.length = seq, pos - node.length, node.length + 1
                child.count += 1
                return child
            node.length += 1
            node.seq, node.start = seq, pos - node.length + 1
            del node.children[token]
            child.start += 1
            child.length -= 1
            node.children[self._token(child)] = child
            return node
        if child.length == 1:
            child.count += 1
            return child
        # Split `child` after its first token: this suffix ends in between.
        middle = _Node(seq, pos, 1, child.count + 1, node)
        node.children[token] = middle
        child.start += 1
        child.length -= 1
        child.parent = middle
        middle.children[self._token(child)] = child
        return middle

    def _match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """The node and offset in its run where `pattern` ends; None when it does not occur."""
        node, offset = self.root, 0
        for token in pattern:
            if offset == node.length:
                node = node.children.get(token)
                if node is None:
                    return None
                offset = 0
            if self._token(node, offset) != token:
                return None
            offset += 1
        return node, offset

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of `pattern` (at most `max_depth` tokens) in the sequences."""
        if not pattern:
            return self.root.count
        found = self._match(pattern)
        return found[0].count if found else 0

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float]:
        """The best-scoring draft to follow `context` (only its last `max_depth` tokens count)
        and its score: the sum of its tokens' estimated probabilities."""
        context = context[-self.max_depth:]
        best: tuple[list[int], float] = ([], 0.0)
        for match_len in range(1, len(context)):
            found = self._match(context[len(context) - match_len:])
            if found is None:
                break
            room = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6))
            draft = self._path(*found, room, min_token_prob)
            if draft[1] >= best[1]:
                best = draft
        return best

    def _path(self, node: _Node, offset: int, max_tokens: int,
              min_token_prob: float) -> tuple[list[int], float]:
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        while len(tokens) < max_tokens and prob >= min_token_prob:
            if offset < node.length:
                tokens.append(self._token(node, offset))
                score += prob
                offset += 1
                continue
            if not node.children:
                break
            child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))[1]
            prob *= child.count / node.count
            node, offset = child, 0
        return tokens, score


class SuffixDrafter:
    """The `suffix` `Drafter`: per-request trees plus the recent responses' trees it shares."""

    name = "suffix"

    def __init__(self, settings: SuffixSettings | None = None):
        self.settings = settings or SuffixSettings()
        self.current = SuffixTree(self.settings.max_depth)  # new responses go here
        self.older: SuffixTree | None = None
        self._next_seq = 0

    def new_state(self, request_id: str) -> SuffixState:
        return SuffixState(self)

    def response_trees(self) -> list[SuffixTree]:
        return [t for t in (self.current, self.older) if t is not None]

    def holds(self, tree: SuffixTree | None) -> bool:
        return tree is not None and (tree is self.current or tree is self.older)

    def new_place(self, response: Sequence[int]) -> tuple[SuffixTree, int]:
        """A new sequence in the current tree, holding `response` so far: `(tree, seq)`. Drops
        the older tree first when the current one holds half the cached requests."""
        half = max(1, self.settings.max_cached_requests // 2)
        if len(self.current.seqs) >= half:
            self.older, self.current = self.current, SuffixTree(self.settings.max_depth)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self.current.extend(seq, response)
        return self.current, seq


class SuffixState:
    """One request: its context (prompt, then response) in its own tree, its response also in the
    drafter's recent responses. The first append is the prompt."""

    def __init__(self, drafter: SuffixDrafter):
        self.drafter = drafter
        self.local = self._tree_of(())
        self.prompt_len: int | None = None
        self._cached: tuple[SuffixTree | None, int] = (None, -1)
        # False without a cache of responses, or once the response was truncated
        self._caching = drafter.settings.max_cached_requests > 0

    def _tree_of(self, token_ids: Sequence[int]) -> SuffixTree:
        tree = SuffixTree(self.drafter.settings.max_depth)
        tree.extend(0, token_ids)  # the request's context is the tree's sequence 0
        return tree

    @property
    def token_ids(self) -> Sequence[int]:
        return self.local.seqs[0]

    def append(self, token_ids: Sequence[int]) -> None:
        context = self.local.seqs[0]  # the list `extend` appends to
        start = len(context)
        self.local.extend(0, token_ids)
        if self.prompt_len is None:
            self.prompt_len = len(context)
        elif self._caching:
            tree, seq = self._cached
            if not self.drafter.holds(tree):
                tree, seq = self._cached = self.drafter.new_place(context[self.prompt_len:start])
            tree.extend(seq, context[start:])

    def truncate(self, num_tokens: int) -> None:
        """Rebuilds the request's tree (a resend from the proposer, rare; the prefetch uses
        `propose_after`), and stops caching its response, whose cached copy stays as it was."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens >= len(self.token_ids):
            return
        self.local = self._tree_of(self.token_ids[:num_tokens])
        self._caching = False

    def propose(self, num_speculative_tokens: int) -> list[int]:
        return self.propose_after((), num_speculative_tokens)

    def propose_after(self, assumed: Sequence[int], num_speculative_tokens: int) -> list[int]:
        """The best draft of the request's tree and the recent responses' trees, for the
        context's last `max_depth` tokens followed by `assumed`."""
        s = self.drafter.settings
        pattern = [*self.token_ids[-s.max_depth:], *assumed]
        best: tuple[list[int], float] = ([], 0.0)
        for tree in (self.local, *self.drafter.response_trees()):
            draft = tree.speculate(pattern, num_speculative_tokens, s.max_spec_factor,
                                   s.min_token_prob)
            if draft[1] > best[1]:
                best = draft
        return best[0]
