"""The router's prefix index as a radix tree keyed by tokens: which worker holds which KV blocks,
answered without hashing the prompt.

KVIndex (kv_index.py) names a prompt's blocks by their SHA-256 chain, so each lookup hashes every block
of the prompt: for a 2048-token shared system prompt, most of a routing decision. Here only the first
block is named by its published hash (it carries the salt, i.e. cache salt and LoRA adapter:
engine/block_hash.py), remembered in a small memo; every later block is found by its tokens under its
parent, where the workers' BlockStored events (parent hash, token ids) put it.

Roots are keyed by the first block's published name. A node holds a run of consecutive blocks with the
same bitmask of holders (path compression): it is split where masks come to differ (a removal in the
middle, a worker storing part of a run) or where prompts branch, and joined with its only child when
their masks become equal again. It keeps its run's tokens msgpack-encoded (each int in its shortest
form, ~3 bytes a token), where each block ends in those bytes, and its blocks' published names; its
children are keyed by the first token of their run.

A lookup encodes the prompt once with msgspec (the one cost that grows with the prompt: ~5 ns a token
on a Zen 3 core when ids mostly share one msgpack width, up to ~10 ns when they straddle 65536 at
random) and checks each node's run with one `startswith` (a memcmp): it costs per node, not per block.
A long prompt that shares little is encoded only as far as needed. Where the prompt
leaves a run midway, a binary search over the run's block ends finds how many whole blocks it shares.
Blocks are matched by their exact tokens (msgpack's int encoding is a prefix code: bytes equal from a
token boundary are tokens equal), so nothing but the first block's 64-bit name can collide, as any of
KVIndex's names can. A prompt whose first block no root starts with is answered without any hashing.

A map from each block's published name to its node serves removals and repeated stores. The answers
are KVIndex's on the same events, but for blocks that cannot be placed: a stored block whose parent
the index does not know (never stored, or held by nobody and pruned before the event came: lost or
reordered events), or that comes without its tokens (`token_ids` not `block_size` per block), is
skipped and counted in `orphans` (blocks). KVIndex keeps such a block, but could only count it for a
worker that also holds every block before it: at worst a worker's overlap is undercounted. Nodes
nobody holds are pruned once they have no children.

Events of every medium count alike (as in KVIndex). Not thread-safe: apply events and look up from one
thread (the router's event loop), as with KVIndex.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, repeat
from operator import add, sub

import msgspec

from tokenmill.engine.block_hash import ROOT_HASH, hash_block
from tokenmill.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, external_hash

_encode = msgspec.msgpack.Encoder().encode
_SNAPSHOT_VERSION = 1
# msgpack int formats by their first byte: how many bytes follow, and whether signed.
_INT_FORMAT = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False)}
_INT_FORMAT.update({0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)})


def _header_len(n: int) -> int:
    """How many bytes msgpack writes before an array of n items."""
    return 1 if n < 16 else 3 if n < 0x10000 else 5


def _first_token(data: bytes | bytearray) -> int:
    """The first token of a msgpack-encoded run (the key a node has among its parent's children)."""
    b = data[0]
    if b < 0x80:
        return b
    if b >= 0xE0:
        return b - 0x100
    size, signed = _INT_FORMAT[b]
    return int.from_bytes(data[1 : 1 + size], "big", signed=signed)


class _Node:
    __slots__ = ("id", "mask", "data", "ends", "hashes", "children", "parent")

    def __init__(
        self, nid: int, mask: int, data: bytearray, ends: array, hashes: array, parent: _Node | None
    ):
        self.id = nid
        self.mask = mask  # bitmask of the worker slots holding every block of the run
        self.data = data  # the run's tokens, msgpack-encoded without an array header
        self.ends = ends  # array('I'): where each block's tokens end in `data`
        self.hashes = hashes  # array('Q'): each block's published name
        # first token of a child's run -> the child (a list of them when runs share a first token)
        self.children: dict[int, _Node | list[_Node]] = {}
        self.parent = parent  # None for a root


def _members(children: dict[int, _Node | list[_Node]]) -> Iterator[_Node]:
    for c in children.values():
        if c.__class__ is list:
            yield from c
        else:
            yield c  # type: ignore[misc]


def _link(parent: _Node, node: _Node) -> None:
    key = _first_token(node.data)
    ch = parent.children
    cur = ch.get(key)
    if cur is None:
        ch[key] = node
    elif cur.__class__ is list:
        cur.append(node)  # type: ignore[union-attr]
    else:
        ch[key] = [cur, node]  # type: ignore[list-item]


def _unlink(parent: _Node, node: _Node) -> None:
    key = _first_token(node.data)
    ch = parent.children
    cur = ch[key]
    if cur is node:
        del ch[key]
    else:
        cur.remove(node)  # type: ignore[union-attr]
        if len(cur) == 1:  # type: ignore[arg-type]
            ch[key] = cur[0]  # type: ignore[index]


def _only_child(node: _Node) -> _Node | None:
    ch = node.children
    if len(ch) != 1:
        return None
    for c in ch.values():
        return None if c.__class__ is list else c  # type: ignore[return-value]
    return None


class RadixKVIndex:
    """Same interface as KVIndex (apply, remove_worker, blocks_per_worker, len), but `overlaps` takes
    the prompt's tokens and salt instead of its hash chain."""

    memo_capacity = 1 << 16  # first blocks whose published name is remembered

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.blocks_per_worker: dict[int, int] = {}
        self.orphans = 0  # stored blocks that could not be placed (see the module docstring)
        self._live = 0  # blocks some worker holds
        self._nodes: dict[int, _Node] = {}  # node id -> node
        self._next_id = 0
        self._where: dict[int, int] = {}  # published block name -> id of the node holding it
        self._roots: dict[int, _Node] = {}  # first block's published name -> node
        self._firsts: dict[bytes, int] = {}  # encoded first block (with header) -> how many roots
        self._memo: dict[tuple[bytes, str | None], int] = {}  # (encoded first block, salt) -> name
        self._block_header = _encode([0] * block_size)[: _header_len(block_size)]

    def __len__(self) -> int:
        return self._live

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    # -- lookups ------------------------------------------------------------------------------------
    def overlaps(self, tokens: Sequence[int], salt: str | None, workers: int) -> dict[int, int]:
        """For each worker slot in the bitmask `workers`, how many leading full blocks of the prompt it
        holds (workers holding none are left out): KVIndex.overlaps of the prompt's hash chain."""
        bs = self.block_size
        total = len(tokens)
        n = total // bs
        if not n:  # as KVIndex answers an empty chain: every worker, with no blocks
            return _each(workers, 0)
        if not workers or not self._roots:
            return {}
        if tokens.__class__ is not list and tokens.__class__ is not tuple:
            tokens = list(map(int, tokens))
        first = tokens[:bs]
        k0 = _encode(first)
        if k0 not in self._firsts:  # nobody holds a block starting this way: no SHA-256 needed
            return {}
        memo = self._memo
        key = (k0, salt)
        h0 = memo.get(key)
        if h0 is None:
            if len(memo) >= self.memo_capacity:
                memo.clear()
            h0 = memo[key] = external_hash(hash_block(ROOT_HASH, first, salt))
        node = self._roots.get(h0)
        if node is None:
            return {}
        out: dict[int, int] = {}
        live = workers
        matched = 0  # blocks of the prompt matched so far
        buf = b""  # the prompt's tokens [.., stop) msgpack-encoded; block `matched` starts at buf[pos]
        pos = stop = 0
        while True:
            now = live & node.mask
            if not now:
                break
            data = node.data
            size = len(node.hashes)
            end = (matched + size) * bs
            if end > stop and stop < total:
                if not stop and 2 * end + 2048 >= total:  # the usual case: the whole prompt at once
                    buf, pos, stop = _encode(tokens), 1 if total < 16 else 3 if total < 0x10000 else 5, total
                else:
                    buf, pos, stop = self._window(tokens, matched * bs, end)
            if matched + size <= n and buf.startswith(data, pos):
                k = size
            else:
                k = _common(node, buf, pos, n - matched)
                if not k:
                    break
            gone = live ^ now  # workers whose run of held blocks ends before this node
            if matched:
                while gone:
                    low = gone & -gone
                    out[low.bit_length() - 1] = matched
                    gone ^= low
            live = now
            matched += k
            if k < size or matched == n:
                break
            pos += len(data)
            nxt = node.children.get(tokens[matched * bs])
            if nxt is None:
                break
            if nxt.__class__ is list:  # runs that share their first token: the one whose first block matches
                for c in nxt:  # type: ignore[union-attr]
                    if buf.startswith(c.data[: c.ends[0]], pos):
                        nxt = c
                        break
                else:
                    break
            node = nxt  # type: ignore[assignment]
        if matched:
            while live:
                low = live & -live
                out[low.bit_length() - 1] = matched
                live ^= low
        return out

    def _window(self, tokens: Sequence[int], start: int, end: int) -> tuple[bytes, int, int]:
        """The prompt's tokens from `start` encoded, at least to `end` and a block past it: the whole rest
        unless that is much longer (a long prompt that shares little need not be encoded whole)."""
        total = len(tokens)
        stop = max(end + max(2048, self.block_size), 2 * end - start)
        if stop + 2048 >= total:
            piece = tokens if start == 0 else tokens[start:]
            stop = total
        else:
            piece = tokens[start:stop]
        return _encode(piece), _header_len(len(piece)), stop

    # -- events -------------------------------------------------------------------------------------
    def apply(self, worker: int, events: Iterable[KVEvent]) -> None:
        bit = 1 << worker
        count = self.blocks_per_worker.get(worker, 0)
        for ev in events:
            if isinstance(ev, BlockStored):
                count += self._store(bit, ev)
            elif isinstance(ev, BlockRemoved):
                count -= self._remove(bit, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.blocks_per_worker[worker] = count
                self.remove_worker(worker)
                count = 0
        if count:
            self.blocks_per_worker[worker] = count
        else:
            self.blocks_per_worker.pop(worker, None)

    def remove_worker(self, worker: int) -> None:
        """Forget every block of a worker (it died, restarted, or its event stream cannot be repaired)."""
        if not self.blocks_per_worker.pop(worker, 0):
            return
        bit = 1 << worker
        order = self._preorder()
        for node in order:
            if node.mask & bit:
                node.mask ^= bit
                if not node.mask:
                    self._live -= len(node.hashes)
        for node in reversed(order):  # children before their parents
            c = _only_child(node)
            if c is not None and c.mask == node.mask:
                node = self._merge(node, c)
            if not node.mask and not node.children:
                self._drop(node)

    def _store(self, bit: int, ev: BlockStored) -> int:
        """Add the worker to the event's blocks; how many it did not hold before."""
        hs = ev.block_hashes
        n = len(hs)
        where, nodes = self._where, self._nodes
        bs = self.block_size
        placeable = ev.block_size == bs and len(ev.token_ids) == n * bs
        added = 0
        i = 0
        while i < n:
            nid = where.get(hs[i])
            if nid is not None:  # known: the worker joins its holders, with the known blocks after it
                node = nodes[nid]
                idx = _index(node, hs[i])
                arr = node.hashes
                limit = min(n - i, len(arr) - idx)
                m = limit
                if m > 1 and arr[idx : idx + m] != array("Q", hs[i : i + m]):
                    m = 1
                    while m < limit and arr[idx + m] == hs[i + m]:
                        m += 1
                if not node.mask & bit:
                    added += self._update(node, idx, idx + m, bit, True)
                i += m
                continue
            j = i + 1
            if j < n and any(map(where.__contains__, hs[j:])):
                while hs[j] not in where:
                    j += 1
            else:
                j = n
            parent: _Node | None = None
            ok = placeable
            if i or ev.parent_block_hash is not None:
                ph = hs[i - 1] if i else ev.parent_block_hash
                pid = where.get(ph)  # type: ignore[arg-type]
                if pid is None:
                    ok = False
                else:
                    parent = nodes[pid]
            if not ok:
                self.orphans += j - i
                i = j
                continue
            run, toks = (hs, ev.token_ids) if j - i == n else (hs[i:j], ev.token_ids[i * bs : j * bs])
            if parent is None:
                node = self._new_node(bit, run, toks, None)
                self._roots[run[0]] = node
                k0 = _encode(toks[:bs])
                self._firsts[k0] = self._firsts.get(k0, 0) + 1
            else:
                pidx = _index(parent, ph)
                last = len(parent.hashes) - 1
                if pidx == last and parent.mask == bit and not parent.children:
                    self._extend(parent, run, toks)
                else:
                    if pidx < last:
                        parent, _ = self._split(parent, pidx + 1)
                    _link(parent, self._new_node(bit, run, toks, parent))
            self._live += j - i
            added += j - i
            i = j
        return added

    def _remove(self, bit: int, hs: list[int]) -> int:
        """Take the worker off these blocks; how many it held. Runs of consecutive blocks (either way
        round: the engine evicts a request's tail first) are cleared at once."""
        where, nodes = self._where, self._nodes
        n = len(hs)
        removed = 0
        i = 0
        while i < n:
            nid = where.get(hs[i])
            if nid is None:
                i += 1
                continue
            node = nodes[nid]
            if not node.mask & bit:
                i += 1
                continue
            arr = node.hashes
            lo = hi = _index(node, hs[i])
            i += 1
            if i < n:
                if lo and arr[lo - 1] == hs[i]:  # descending, as evictions come: compare the run at once
                    m = min(n - i, lo)
                    run = arr[lo - m : lo]
                    run.reverse()
                    if run == array("Q", hs[i : i + m]):
                        lo -= m
                        i += m
                    else:
                        while i < n and lo and arr[lo - 1] == hs[i]:
                            lo -= 1
                            i += 1
                elif hi + 1 < len(arr) and arr[hi + 1] == hs[i]:
                    while i < n and hi + 1 < len(arr) and arr[hi + 1] == hs[i]:
                        hi += 1
                        i += 1
            removed += self._update(node, lo, hi + 1, bit, False)
        return removed

    # -- tree surgery -------------------------------------------------------------------------------
    def _block_ends(self, tokens: list[int], base: int) -> Iterator[int]:
        """Where each block of a run ends in its encoding, offset by `base` (a block encoded at a time)."""
        bs = self.block_size
        blocks = zip(*[iter(tokens)] * bs, strict=True)
        ends = accumulate(map(sub, map(len, map(_encode, blocks)), repeat(_header_len(bs))), initial=base)
        next(ends)
        return ends

    def _new_node(self, mask: int, hashes: list[int], tokens: list[int], parent: _Node | None) -> _Node:
        nid = self._next_id
        self._next_id += 1
        data = bytearray(_encode(tokens)[_header_len(len(tokens)) :])
        node = _Node(nid, mask, data, array("I", self._block_ends(tokens, 0)), array("Q", hashes), parent)
        self._nodes[nid] = node
        self._where.update(dict.fromkeys(hashes, nid))
        return node

    def _extend(self, node: _Node, hashes: list[int], tokens: list[int]) -> None:
        node.ends.extend(self._block_ends(tokens, len(node.data)))
        node.data += _encode(tokens)[_header_len(len(tokens)) :]
        node.hashes.extend(array("Q", hashes))
        self._where.update(dict.fromkeys(hashes, node.id))

    def _split(self, node: _Node, k: int) -> tuple[_Node, _Node]:
        """Cut a node after its first k blocks: (front, back), the back the front's only child. The
        smaller part moves to a new node (the blocks moved are re-pointed one by one)."""
        ends = node.ends
        cut = ends[k - 1]
        nid = self._next_id
        self._next_id += 1
        if 2 * k <= len(ends):  # the front moves, taking the node's place under its parent
            front = _Node(nid, node.mask, node.data[:cut], ends[:k], node.hashes[:k], node.parent)
            del node.data[:cut]
            node.ends = array("I", map(sub, ends[k:], repeat(cut)))
            del node.hashes[:k]
            self._replace(node, front)
            node.parent = front
            front.children = {_first_token(node.data): node}
            moved = front
        else:  # the back moves, taking the node's children
            back = _Node(
                nid, node.mask, node.data[cut:], array("I", map(sub, ends[k:], repeat(cut))), None, node
            )
            back.hashes = node.hashes[k:]
            del node.data[cut:]
            del ends[k:]
            del node.hashes[k:]
            back.children = node.children
            for c in _members(back.children):
                c.parent = back
            node.children = {_first_token(back.data): back}
            front, node, moved = node, back, back
        self._nodes[nid] = moved
        self._where.update(dict.fromkeys(moved.hashes, nid))
        return front, node

    def _merge(self, node: _Node, child: _Node) -> _Node:
        """Join a node and its only child, of the same mask, into one; which one is kept is returned
        (the larger: the blocks of the other are re-pointed one by one)."""
        if len(node.hashes) >= len(child.hashes):
            keep, gone = node, child
            base = len(node.data)
            node.data += child.data
            node.ends.extend(map(add, child.ends, repeat(base)))
            node.hashes.extend(child.hashes)
            node.children = child.children
            for c in _members(node.children):
                c.parent = node
        else:
            keep, gone = child, node
            base = len(node.data)
            ends = node.ends
            ends.extend(map(add, child.ends, repeat(base)))
            child.ends = ends
            child.data[:0] = node.data
            child.hashes = node.hashes + child.hashes
            child.parent = node.parent
            self._replace(node, child)
        del self._nodes[gone.id]
        self._where.update(dict.fromkeys(gone.hashes, keep.id))
        return keep

    def _replace(self, node: _Node, other: _Node) -> None:
        """Put `other`, whose run starts as the node's does, in the node's place under its parent."""
        parent = node.parent
        if parent is None:
            self._roots[other.hashes[0]] = other
            return
        ch = parent.children
        key = _first_token(other.data)
        cur = ch[key]
        if cur is node:
            ch[key] = other
        else:
            cur[cur.index(node)] = other  # type: ignore[union-attr]

    def _drop(self, node: _Node) -> None:
        """Forget a node no worker holds and that has no children."""
        where = self._where
        for h in node.hashes:
            del where[h]
        del self._nodes[node.id]
        parent = node.parent
        if parent is None:
            del self._roots[node.hashes[0]]
            k0 = self._block_header + bytes(node.data[: node.ends[0]])
            left = self._firsts[k0] - 1
            if left:
                self._firsts[k0] = left
            else:
                del self._firsts[k0]
        else:
            _unlink(parent, node)

    def _update(self, node: _Node, a: int, b: int, bit: int, add_: bool) -> int:
        """Add (or take off) a worker to blocks a..b-1 of a node, whose mask has (or lacks) its bit;
        how many blocks that is. The node is split where masks now differ, joined with its parent or
        child where they are now equal, and pruned if nobody holds it and it has no children."""
        old = node.mask
        new = old | bit if add_ else old & ~bit
        if not new and a and b == len(node.hashes) and not node.children:
            # the end of a leaf's run, which nobody holds now (as the engine evicts): cut it off
            where = self._where
            for h in node.hashes[a:]:
                del where[h]
            ends = node.ends
            del node.data[ends[a - 1] :]
            del ends[a:]
            del node.hashes[a:]
            self._live -= b - a
            return b - a
        if a:
            _, node = self._split(node, a)
            b -= a
        if b < len(node.hashes):
            node, _ = self._split(node, b)
        node.mask = new
        if not old:
            self._live += b
        elif not new:
            self._live -= b
        if not new and not node.children:
            parent = node.parent
            self._drop(node)
            while parent is not None and not parent.mask and not parent.children:
                up = parent.parent
                self._drop(parent)
                parent = up
            if parent is not None:
                c = _only_child(parent)
                if c is not None and c.mask == parent.mask:
                    self._merge(parent, c)
            return b
        parent = node.parent
        if parent is not None and parent.mask == new and _only_child(parent) is node:
            node = self._merge(parent, node)
        c = _only_child(node)
        if c is not None and c.mask == new:
            self._merge(node, c)
        return b

    def _preorder(self) -> list[_Node]:
        out: list[_Node] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(_members(node.children))
        return out

    # -- warm restart -------------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The whole index as msgpack (plain data), for `restore` in another process: per node, in
        pre-order, its parent's position, mask, encoded tokens, block ends and block names."""
        nodes = self._preorder()
        order = {node.id: i for i, node in enumerate(nodes)}
        rows = [
            (
                -1 if node.parent is None else order[node.parent.id],
                node.mask.to_bytes((node.mask.bit_length() + 7) // 8, "little"),
                bytes(node.data),
                node.ends.tobytes(),
                node.hashes.tobytes(),
            )
            for node in nodes
        ]
        return msgspec.msgpack.encode(
            {
                "version": _SNAPSHOT_VERSION,
                "block_size": self.block_size,
                "byteorder": sys.byteorder,
                "orphans": self.orphans,
                "blocks_per_worker": sorted(self.blocks_per_worker.items()),
                "nodes": rows,
            }
        )

    @classmethod
    def restore(cls, data: bytes) -> RadixKVIndex:
        raw = msgspec.msgpack.decode(data)
        if raw.get("version") != _SNAPSHOT_VERSION:
            raise ValueError(f"unsupported radix index snapshot version {raw.get('version')!r}")
        index = cls(raw["block_size"])
        index.orphans = raw["orphans"]
        index.blocks_per_worker = {w: c for w, c in raw["blocks_per_worker"]}
        swap = raw["byteorder"] != sys.byteorder
        built: list[_Node] = []
        for parent_at, mask, tokens, ends_raw, hashes_raw in raw["nodes"]:
            ends, hashes = array("I"), array("Q")
            ends.frombytes(ends_raw)
            hashes.frombytes(hashes_raw)
            if swap:
                ends.byteswap()
                hashes.byteswap()
            parent = None if parent_at < 0 else built[parent_at]
            node = _Node(
                index._next_id, int.from_bytes(mask, "little"), bytearray(tokens), ends, hashes, parent
            )
            index._next_id += 1
            built.append(node)
            index._nodes[node.id] = node
            index._where.update(dict.fromkeys(hashes, node.id))
            if node.mask:
                index._live += len(hashes)
            if parent is None:
                index._roots[hashes[0]] = node
                k0 = index._block_header + bytes(node.data[: ends[0]])
                index._firsts[k0] = index._firsts.get(k0, 0) + 1
            else:
                _link(parent, node)
        return index


def _each(workers: int, value: int) -> dict[int, int]:
    out = {}
    while workers:
        low = workers & -workers
        out[low.bit_length() - 1] = value
        workers ^= low
    return out


def _index(node: _Node, h: int) -> int:
    """Where a block is in its node's run (usually at an end: a parent, a run's first or last block)."""
    arr = node.hashes
    last = len(arr) - 1
    if arr[last] == h:
        return last
    if arr[0] == h:
        return 0
    if last < 64:
        return arr.index(h)
    needle = h.to_bytes(8, sys.byteorder)
    raw = arr.tobytes()
    p = raw.find(needle)
    while p & 7:
        if p < 0:
            raise KeyError(h)
        p = raw.find(needle, p + 1)
    return p >> 3


def _common(node: _Node, buf: bytes, pos: int, avail: int) -> int:
    """How many leading blocks of the node's run (at most `avail`) the encoded prompt has at `pos`."""
    ends = node.ends
    lo, hi = 0, min(len(ends), avail)
    with memoryview(node.data) as data:
        if hi and buf.startswith(data[: ends[hi - 1]], pos):
            return hi
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if buf.startswith(data[: ends[mid - 1]], pos):
                lo = mid
            else:
                hi = mid - 1
    return lo
