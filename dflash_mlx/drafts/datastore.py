"""Drafts from the target's own past text: a suffix array over what it wrote before.

A small target says the same things again and again, across answers as well as within one
("It is important to", "Here are some tips"). Prompt lookup finds repeats inside the current
text; the datastore finds them in everything the target wrote before: a response cache shipped
with a pair, and each reply of the running process as it is produced (SuffixDecoding, arXiv
2411.04975, and REST, arXiv 2311.08252, draft the same way).

The longest suffix of the text (up to ``max_order`` tokens) that occurs in the store picks a range
of the suffix array; the continuation drafted is the most frequent next token there, then the
most frequent one after that, narrowing the range, while the estimated chance that the whole
draft so far is right stays above ``min_path`` and each step's share above ``min_step``. Drafts
are certain (one-hot), so verification keeps exactly what the target's own samples agree with:
lossless whatever the store holds.

Memory: 8 bytes a stored token (token ids and suffix array, int32), plus the same for the
session's replies, at most ``session_tokens`` of them (the oldest dropped first).
"""

import gzip
import hashlib
import heapq
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base.errors import DFlashError
from ..loading.pairs import default_pair_answers, default_pair_draft
from ..loop.proposal import Proposal, Proposer
from ..models.target import vocab_size

# Suffixes are sorted by their first SORTED tokens only (five doubling rounds): a draft never
# reads deeper than its match plus its drafts.
SORTED = 32


def suffix_array(tokens: np.ndarray, depth: int | None = None) -> np.ndarray:
    """The suffix array of ``tokens`` (non-negative ints) by prefix doubling in numpy, sorted
    by the first ``depth`` tokens of each suffix (None: whole suffixes), suffixes equal that far
    in text order. A document's end is a separator the caller makes unique, so no order depends
    on what follows it."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    _, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64)
    k = 1
    while True:
        # (rank of i, rank of i + k) as one int64 key; past the end sorts first.
        second = np.zeros(n, dtype=np.int64)
        second[: n - k] = rank[k:] + 1
        key = rank * (n + 1) + second
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate([[0], np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        rank = new
        if rank[order[-1]] == n - 1 or k >= n or (depth is not None and 2 * k >= depth):
            return order.astype(np.int32)
        k *= 2


@dataclass
class SuffixIndex:
    """Token ids with their suffix array; documents end in unique separators (ids >= ``vocab``)."""

    tokens: np.ndarray  # (n,) int32
    sa: np.ndarray  # (n,) int32
    vocab: int

    @classmethod
    def build(cls, documents: list[list[int]], vocab: int) -> "SuffixIndex":
        parts = []
        for i, doc in enumerate(documents):
            parts.append(np.asarray(doc, dtype=np.int64))
            parts.append(np.array([vocab + i], dtype=np.int64))  # unique: no match runs across documents
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(tokens) and tokens.max() >= 2**31:
            raise DFlashError("The datastore holds at most 2**31 tokens and documents.")
        return cls(tokens.astype(np.int32), suffix_array(tokens, SORTED), vocab)

    def __len__(self) -> int:
        return len(self.tokens)

    def _bound(self, pattern: list[int], lo: int, hi: int, upper: bool) -> int:
        # First suffix in [lo, hi) whose first len(pattern) tokens are >= (upper: >) pattern.
        m = len(pattern)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(self.sa[mid])
            head = self.tokens[start : start + m].tolist()
            if head < pattern or (upper and head == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """The range of suffixes that start with ``pattern`` (empty: ``lo == hi``)."""
        lo = self._bound(pattern, 0, len(self.sa), upper=False)
        return lo, self._bound(pattern, lo, len(self.sa), upper=True)

    def _token_at(self, i: int, depth: int) -> int:
        at = int(self.sa[i]) + depth
        return int(self.tokens[at]) if at < len(self.tokens) else -1

    def narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """The part of a range (whose suffixes share ``depth`` tokens) that continues with ``token``."""
        start = self._bound_at(lo, hi, depth, token, upper=False)
        return start, self._bound_at(start, hi, depth, token, upper=True)

    def _bound_at(self, lo: int, hi: int, depth: int, token: int, upper: bool) -> int:
        # First suffix in [lo, hi) whose token at ``depth`` is >= (upper: >) ``token``.
        while lo < hi:
            mid = (lo + hi) // 2
            at = self._token_at(mid, depth)
            if at < token or (upper and at == token):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def next_counts(self, lo: int, hi: int, depth: int, limit: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
        """The tokens that follow the range's common prefix of ``depth`` tokens, and how many
        suffixes continue with each (in suffix-array order; at most ``limit`` suffixes read)."""
        if hi - lo > limit:  # a short, common suffix: an even sample of its range
            idx = self.sa[np.linspace(lo, hi - 1, limit).astype(np.int64)]
        else:
            idx = self.sa[lo:hi]
        idx = idx.astype(np.int64) + depth
        idx = idx[idx < len(self.tokens)]
        nxt = self.tokens[idx]
        values, counts = np.unique(nxt, return_counts=True)
        return values, counts * ((hi - lo) / max(len(idx), 1))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial.npz")
        try:
            np.savez(tmp, tokens=self.tokens, sa=self.sa, vocab=np.array(self.vocab))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only cache folder: built again next time

    @classmethod
    def load(cls, path: Path) -> "SuffixIndex | None":
        try:
            with np.load(path) as f:
                return cls(f["tokens"], f["sa"], int(f["vocab"]))
        except (OSError, KeyError, ValueError):
            return None


@dataclass(frozen=True)
class Draft:
    """A datastore draft: its tokens, the length of the text's suffix it matched, and each
    token's share of the continuations there (given the tokens before it)."""

    tokens: list[int]
    match: int
    shares: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Branch:
    """A node of :meth:`Datastore.branches`' tree: its parent (0: the root, ``i``: the ``i``-th node),
    its token and its share of the continuations after its parent."""

    parent: int
    token: int
    share: float


@dataclass
class Datastore:
    """The target's past text, searchable by suffix: a fixed part (a response cache) and the
    replies of this process, added with :meth:`add`.

    Args:
        fixed: The index of a response cache, or None.
        vocab: The target's vocabulary size (ids at or above it are document separators).
        max_order: Longest suffix of the text matched.
        min_order: Shortest suffix matched.
        min_step: Least share of the range a next token must have to be drafted.
        min_path: Least estimated chance (the product of the steps' shares) of the whole draft.
        min_count: Least number of earlier occurrences of a drafted continuation.
        session_tokens: Most tokens of this process's replies kept (oldest dropped first).
        learns: Whether :meth:`add` keeps replies (a benchmark's runs must not draft from each
          other's answers to the same prompt).
    """

    fixed: SuffixIndex | None
    vocab: int
    max_order: int = 4
    min_order: int = 2
    min_step: float = 0.25
    min_path: float = 0.1
    min_count: int = 2
    session_tokens: int = 1 << 20
    learns: bool = True
    _replies: list[list[int]] = field(default_factory=list, init=False, repr=False)
    _session: SuffixIndex | None = field(default=None, init=False, repr=False)
    _stale: bool = field(default=False, init=False, repr=False)

    def add(self, tokens: list[int]) -> None:
        """Keep a reply of the target's (token ids) for the drafts that follow."""
        if len(tokens) < 2 or not self.learns:
            return
        self._replies.append([int(t) for t in tokens])
        total = sum(map(len, self._replies))
        while total > self.session_tokens and len(self._replies) > 1:
            total -= len(self._replies.pop(0))
        self._stale = True

    @property
    def session_length(self) -> int:
        return sum(map(len, self._replies))

    @property
    def nbytes(self) -> int:
        """Bytes its indexes take."""
        parts = [self.fixed, self._session]
        return sum(p.tokens.nbytes + p.sa.nbytes for p in parts if p is not None)

    def _indexes(self) -> list[SuffixIndex]:
        if self._stale:
            self._session = SuffixIndex.build(self._replies, self.vocab) if self._replies else None
            self._stale = False
        return [i for i in (self._session, self.fixed) if i is not None and len(i)]

    def draft(self, text: list[int], n: int) -> Draft:
        """Up to ``n`` tokens to follow ``text``, from the longest suffix of it whose continuation
        either part is sure enough of: the session's replies first, then the fixed part (a phrase
        the session said once must not hide what the cache says every time), then a shorter
        suffix (a long match seen once says less than a shorter one seen often: 2.51 tokens a
        cycle against 2.45 on the default pair's held-out answers replayed, BENCHMARKS.md)."""
        indexes = self._indexes()
        if n < 1 or not indexes:
            return Draft([], 0)
        for order in range(min(self.max_order, len(text)), self.min_order - 1, -1):
            pattern = [int(t) for t in text[-order:]]
            for index in indexes:
                lo, hi = index.find(pattern)
                if hi > lo:
                    tokens, shares = self._walk(index, lo, hi, order, n)
                    if tokens:
                        return Draft(tokens, order, shares)
        return Draft([], 0)

    def branches(self, text: list[int], nodes: int, depth: int, width: int = 3) -> tuple[int, list[Branch]]:
        """Up to ``nodes`` continuations of ``text`` as a tree, most frequent first (SuffixDecoding's
        tree, arXiv 2411.04975): from the suffix that :meth:`draft` matches, each node a next token
        with its share of the continuations after its parent, at most ``width`` children a node and
        ``depth`` levels, under the same thresholds as :meth:`draft`'s one path (whose tokens are the
        tree's first children). Best first: every node comes after its parent.

        Returns:
            ``(match, branches)``: the length of the suffix matched (0: none) and the nodes.
        """
        indexes = self._indexes()
        if nodes < 1 or depth < 1 or not indexes:
            return 0, []
        for order in range(min(self.max_order, len(text)), self.min_order - 1, -1):
            pattern = [int(t) for t in text[-order:]]
            for index in indexes:
                lo, hi = index.find(pattern)
                if hi > lo:
                    found = self._grow(index, lo, hi, order, nodes, order + depth, width)
                    if found:
                        return order, found
        return 0, []

    def _children(self, index: SuffixIndex, lo: int, hi: int, depth: int, path: float, width: int):
        # The next tokens of a range that pass the thresholds: (share, token, count), most frequent first.
        if depth >= SORTED or hi <= lo:
            return []
        values, counts = index.next_counts(lo, hi, depth)
        out = []
        for j in np.argsort(-counts, kind="stable")[:width]:
            token, count = int(values[j]), float(counts[j])
            share = count / (hi - lo)
            if token >= self.vocab or count < self.min_count or share < self.min_step or path * share < self.min_path:
                break
            out.append((share, token))
        return out

    def _grow(self, index: SuffixIndex, lo: int, hi: int, depth: int, budget: int, end: int, width: int):
        found, heap, pushed = [], [], 0
        # (-path, push order, parent node, token, share, range of the parent, parent depth)
        for share, token in self._children(index, lo, hi, depth, 1.0, width):
            heap.append((-share, pushed, 0, token, share, lo, hi, depth))
            pushed += 1
        heapq.heapify(heap)
        while heap and len(found) < budget:
            neg_path, _, parent, token, share, lo, hi, depth = heapq.heappop(heap)
            found.append(Branch(parent, token, share))
            if depth + 1 >= end:
                continue
            # Suffixes are sorted, so those that continue with ``token`` are a contiguous run.
            lo, hi = index.narrow(lo, hi, depth, token)
            for child_share, child in self._children(index, lo, hi, depth + 1, -neg_path, width):
                heapq.heappush(
                    heap, (neg_path * child_share, pushed, len(found), child, child_share, lo, hi, depth + 1)
                )
                pushed += 1
        return found

    def _walk(self, index: SuffixIndex, lo: int, hi: int, depth: int, n: int) -> tuple[list[int], list[float]]:
        out, shares, path = [], [], 1.0
        while len(out) < n and hi > lo and depth < SORTED:
            values, counts = index.next_counts(lo, hi, depth)
            if len(values) == 0:
                break
            j = int(np.argmax(counts))
            token, count = int(values[j]), float(counts[j])
            share = count / (hi - lo)
            path *= share
            if token >= self.vocab or count < self.min_count or share < self.min_step or path < self.min_path:
                break
            out.append(token)
            shares.append(share)
            # Suffixes are sorted, so those that continue with ``token`` are a contiguous run.
            lo, hi = index.narrow(lo, hi, depth, token)
            depth += 1
        return out, shares


def read_responses(path: str | Path) -> list[list[int]]:
    """The responses of a response cache (dflash-train's JSONL, gzipped or not), token ids."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            return [json.loads(line)["response_ids"] for line in f if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DFlashError(
            f"Cannot read the response cache {path}: {e}. Pass a dflash-train response cache "
            "(JSONL with response_ids per line, optionally gzipped)."
        ) from None


def load_datastore(responses: str | Path, vocab: int, cache_dir: str | Path | None = None, **settings) -> Datastore:
    """A datastore over a response cache's responses; its index is built once (seconds) and kept in
    ``cache_dir`` (dflash-mlx's cache folder by default), keyed by the file's contents."""
    responses = Path(responses)
    if cache_dir is None:
        from ..base.store import default_cache_root

        cache_dir = default_cache_root() / "datastore"
    digest = hashlib.sha256(responses.read_bytes()).hexdigest()[:16]
    path = Path(cache_dir) / f"{digest}-{vocab}-{SORTED}.npz"
    index = SuffixIndex.load(path)
    if index is None:
        documents = read_responses(responses)
        # Once per file and vocabulary; said, since it takes a while and writes to the cache folder.
        print(
            f"Indexing {responses.name} for the datastore ({sum(map(len, documents)):,} tokens, once; "
            f"kept in {path.parent})...",
            file=sys.stderr,
            flush=True,
        )
        index = SuffixIndex.build(documents, vocab)
        index.save(path)
    return Datastore(index, vocab, **settings)


# What pair_datastore opened, by answers file and vocabulary: one store a process, as a tool keeps
# one a session, so each reply joins the store the next call drafts from.
_PAIR_STORES: dict[tuple[Path, int], Datastore] = {}


def pair_datastore(model: nn.Module, draft: nn.Module | None) -> Datastore | None:
    """What the Python API's ``datastore="auto"`` drafts from, as the tools' ``--datastore auto``.

    Args:
        model: The target.
        draft: The drafter; :func:`dflash_mlx.load` records the folder it read it from.

    Returns:
        The default pair's shipped answers (a file of the package: nothing is downloaded) when
        ``draft`` is the default pair's drafter, opened once a process, this process's replies
        joining it; None for any other drafter, whose pair ships no answers, and for plain
        decoding (prompt lookup alone, as before).
    """
    folder = getattr(draft, "folder", None)
    answers = default_pair_answers()
    if folder is None or Path(folder).resolve() != default_pair_draft().resolve() or not answers.is_file():
        return None
    vocab = vocab_size(model)
    if (answers, vocab) not in _PAIR_STORES:
        _PAIR_STORES[answers, vocab] = load_datastore(answers, vocab)
    return _PAIR_STORES[answers, vocab]


class DatastoreProposer(Proposer):
    """Drafts from a :class:`Datastore` after the committed ``history`` (the pair cache's tokens,
    which the loop extends in place)."""

    tap_ids: list[int] = []

    def __init__(self, store: Datastore, history: list[int], block_size: int):
        self.store, self.history, self.block_size = store, history, block_size

    def propose(self, last: int, n: int) -> Proposal:
        text = self.history[-self.store.max_order :] + [last]
        found = self.store.draft(text, min(n, self.block_size - 1))
        return Proposal(mx.array(found.tokens, dtype=mx.uint32), None, "datastore")

    def plain_next(self) -> bool:
        return False

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        pass
