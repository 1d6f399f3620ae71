"""PagedKVCache: the block allocator under random appends, press write-backs, pipeline cuts, kvpress-style masked
evictions, batch rearrangements (beam search's reorder, repeated and selected rows) and trims (no block leaked or owned
twice, lengths add up, every head holds exactly its own tokens in order, the rectangular view matches a DynamicCache's
layout); memory accounting; bad input."""

import math
import random
import re

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicLayer

import kvpress_cpp  # noqa: F401
from kvpress_cpp.cache import LayerState, get_state, set_state
from kvpress_cpp.paged_cache import PagedKVCache, PagedLayer

INF = float("inf")


def check_allocator(layer: PagedLayer):
    """No block owned twice or leaked; each head holds the blocks its length needs (and at most one emptied block)."""
    layer.flush()
    tables = layer.block_tables
    used = tables[tables >= 0].tolist()
    assert len(set(used)) == len(used), "a block is owned twice"
    assert not set(used) & set(layer.free_blocks), "a block is both owned and free"
    assert len(set(layer.free_blocks)) == len(layer.free_blocks), "a block is free twice"
    assert len(used) + len(layer.free_blocks) == layer.key_blocks.shape[0], "a block leaked"
    owned = (tables >= 0).sum(-1)
    needed = (layer.lengths + layer.block_size - 1) // layer.block_size
    # A head shortened by less than a block may keep the one block it emptied; an empty head holds nothing.
    spare = owned - needed
    assert bool(((spare == 0) | ((spare == 1) & (layer.lengths > 0))).all()), (owned, needed)
    for b in range(tables.shape[0]):
        for h in range(tables.shape[1]):
            row = tables[b, h]
            assert bool((row[:int(owned[b, h])] >= 0).all()) and bool((row[int(owned[b, h]):] < 0).all())
    assert layer.bytes_held() == len(used) * layer._block_bytes()


def view_ids(layer) -> torch.Tensor:
    """(B, H, W) token ids of the view (0 on padding): keys hold [id, 2 id], values -id."""
    keys, values = layer.keys, layer.values
    assert torch.equal(keys[..., 1], 2 * keys[..., 0]) and torch.equal(values[..., 0], -keys[..., 0])
    return keys[..., 0].long()


def head_tokens(ids: torch.Tensor) -> list[list[list[int]]]:
    return [[[t for t in row.tolist() if t] for row in head] for head in ids]


class AttentionModule:
    """Stands for an attention module on which kvpress's head-wise presses set masked_key_indices."""

    masked_key_indices = None


class Model:
    """The same history on a DynamicCache (compacted by compact_to_longest_head, as our presses leave it): its
    rectangular token ids, and which of them kvpress's head-wise marks hide. A masked slot keeps its column there (the
    paged layer evicts it for real): a cut keys[:, :, :n] keeps each head's tokens before column n of this layout, and
    the width counts the masked columns."""

    def __init__(self, batch, heads):
        self.rect = torch.zeros(batch, heads, 0, dtype=torch.long)
        self.masked = torch.zeros(batch, heads, 0, dtype=torch.bool)

    def append(self, ids):
        self.rect = torch.cat([self.rect, ids], -1)
        self.masked = torch.cat([self.masked, torch.zeros(ids.shape, dtype=torch.bool)], -1)

    def held(self) -> list[list[list[int]]]:
        """Each head's token ids in order, masked ones left out (the slots the paged layer holds)."""
        return head_tokens(self.rect.masked_fill(self.masked, 0))

    def compact(self, ids, keep, width=None):
        """A press's write of the view `ids` (B, H, W): each head's ids where `keep` first (the masked ones are gone),
        as wide as the longest head (or `width`)."""
        heads = [[[t for t in row if t in set(ids[b, h][keep[b, h]].tolist())] for h, row in enumerate(head)]
                 for b, head in enumerate(self.held())]
        width = width if width is not None else max((len(row) for head in heads for row in head), default=0)
        self.rect = torch.zeros(*self.rect.shape[:2], width, dtype=torch.long)
        for b, head in enumerate(heads):
            for h, row in enumerate(head):
                self.rect[b, h, :len(row)] = torch.tensor(row, dtype=torch.long)
        self.masked = torch.zeros(self.rect.shape, dtype=torch.bool)

    def mask(self, b, h, token):
        self.masked[b, h] |= self.rect[b, h] == token

    def cut(self, width):
        self.rect, self.masked = self.rect[..., :width], self.masked[..., :width]

    def take_rows(self, rows):
        self.rect, self.masked = self.rect[rows], self.masked[rows]


OPS = ["append", "append", "press", "merge", "mark", "mark", "cut", "mask", "trim"]
# Batch rearrangements, without kvpress's marks: a batch of one row has few heads, whose random marks then often hide
# the latest token of every head, where a cut after marks counts each head's appended slots back from the latest token
# held (kvpress's presses spare it: PagedLayer._appended_before).
OPS_REARRANGING_ROWS = ["append", "append", "press", "merge", "mark", "mark", "cut", "trim", "rows", "rows"]


@pytest.mark.parametrize("ops", [OPS, OPS_REARRANGING_ROWS], ids=["marks", "rows"])
@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_appends_evictions_and_cuts(seed, block_size, ops):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch, heads = 2, 3
    cache = PagedKVCache(block_size=block_size)
    model = Model(batch, heads)
    next_id, position = 1, 0
    positions = {}  # id -> absolute position, for ids whose position the layer still knows
    dead = set()  # ids a press marked -inf without moving any slot (kept as dead slots)
    marks_evicted = False  # whether the marks evicted slots since the last press's write
    module = AttentionModule()
    for step in range(80):
        op = rng.choice(ops) if step else "append"
        layer = cache.layers[0] if cache.layers else None
        if op == "append":
            q = rng.randint(1, 7)
            ids = torch.arange(next_id, next_id + batch * heads * q).view(batch, heads, q)
            for offset, token in enumerate(ids.flatten().tolist()):
                positions[token] = position + (offset % q)
            next_id += ids.numel()
            keys = torch.stack([ids.float(), 2 * ids.float()], -1)
            cache.update(keys, -keys, 0, {"cache_position": torch.arange(position, position + q)})
            position += q
            model.append(ids)
            layer = cache.layers[0]
            layer.attended_by(module)
        elif op == "press":
            ids = view_ids(layer)
            keep = (ids > 0) & (torch.rand(ids.shape) < 0.6)
            keys, values = layer.keys.clone(), layer.values.clone()
            layer.keys, layer.values = keys, values
            set_state(layer, LayerState(torch.zeros(ids.shape).masked_fill(~keep, -INF), {"scores": ids.float()},
                                        {"step": step}))
            model.compact(ids, keep)
            positions, dead, marks_evicted = {}, set(), False  # a press may merge or reorder: positions are forgotten
        elif op == "merge":  # a merging press's decoding step (keeps_held_slots): it keeps every slot it is given,
            # so what it writes is -inf only where the view showed padding or a dead slot, which must still be dropped
            ids = view_ids(layer)
            held = (ids > 0) & ~torch.isin(ids, torch.tensor(sorted(dead), dtype=torch.long))
            layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            state = LayerState(torch.zeros(ids.shape).masked_fill(~held, -INF), {"scores": ids.float()}, {"step": step})
            state.keeps_held_slots = True
            set_state(layer, state)
            model.compact(ids, held)
            positions, dead, marks_evicted = {}, set(), False
        elif op == "mark":  # KVzap between its compactions: the view's own keys and values back, a few slots -inf
            keys, values = layer.keys, layer.values
            ids = view_ids(layer)
            had_state = get_state(layer) is not None
            dead |= set(ids[(ids > 0) & (torch.rand(ids.shape) < 0.15)].tolist())
            is_dead = torch.isin(ids, torch.tensor(sorted(dead), dtype=torch.long)) & (ids > 0)
            layer.keys, layer.values = keys, values
            set_state(layer, LayerState(torch.zeros(ids.shape).masked_fill(is_dead | (ids == 0), -INF),
                                        {"scores": ids.float()}, {"step": step}))
            if had_state and bool((is_dead.sum(-1) <= 2 * block_size).all()):
                # Every slot stays; the view shows each head's from column 0, and keeps the columns only rows a
                # rearrangement dropped held (the rectangular cache keeps them), not those marks emptied.
                model.compact(ids, ids > 0, width=None if marks_evicted else model.rect.shape[-1])
            else:  # no state of a press to keep beside, or too many dead slots: the layer is compacted
                model.compact(ids, (ids > 0) & ~is_dead)
                positions, dead = {}, set()  # a rewrite, as a press's
            marks_evicted = False
        elif op == "cut":
            width = rng.randint(0, layer.get_seq_length())
            layer.keys = layer.keys[:, :, :width]
            layer.values = layer.values[:, :, :width]
            model.cut(width)
        elif op == "trim":
            cache.trim()
            assert layer.bytes_reserved() == layer.bytes_held()
        elif op == "rows":  # beam search's reorder (rows repeated and dropped), n samples, some rows kept
            how = rng.choice(["reorder_cache", "batch_repeat_interleave", "batch_select_indices"])
            if how == "reorder_cache":
                rows = torch.tensor([rng.randrange(batch) for _ in range(rng.randint(1, 3))])
                cache.reorder_cache(rows)
            elif how == "batch_repeat_interleave":
                repeats = rng.randint(1, max(1, 4 // batch))
                rows = torch.arange(batch).repeat_interleave(repeats)
                cache.batch_repeat_interleave(repeats)
            else:
                rows = torch.tensor(sorted(rng.sample(range(batch), rng.randint(1, batch))))
                cache.batch_select_indices(rows)
            model.take_rows(rows)
            batch = len(rows)
        else:  # kvpress's head-wise masking (AdaKV, DMS): module.masked_key_indices in absolute positions
            ids = view_ids(layer)
            marked = [(b, h, int(t)) for b in range(batch) for h in range(heads) for t in ids[b, h].tolist()
                      if t and rng.random() < 0.3]
            if not marked:
                continue
            module.masked_key_indices = tuple(
                torch.tensor(column) for column in zip(*[(b, h, positions.get(t, 10 ** 6)) for b, h, t in marked]))
            evicted = torch.zeros_like(ids, dtype=torch.bool)
            for b, h, t in marked:
                if t in positions:
                    evicted[b, h] = evicted[b, h] | (ids[b, h] == t)
            before = head_tokens(ids)
            layer.flush()
            assert module.masked_key_indices is None
            expected = [[[t for t in row if not bool((ids[b, h] == t)[evicted[b, h]].any())]
                         for h, row in enumerate(head)] for b, head in enumerate(before)]
            assert head_tokens(view_ids(layer)) == expected
            for b, h, t in marked:
                if t in positions:
                    model.mask(b, h, t)
            marks_evicted = marks_evicted or bool(evicted.any())
        check_allocator(layer)
        # Each head holds the DynamicCache's unmasked tokens, in order, in a view as wide as that cache; until marks
        # evict slots, at the DynamicCache's columns (once they did, a head's later slots sit further left or right).
        assert head_tokens(view_ids(layer)) == model.held(), f"step {step} ({op})"
        assert layer.get_seq_length() == model.rect.shape[-1], f"step {step} ({op})"
        if not marks_evicted:
            assert torch.equal(view_ids(layer), model.rect), f"step {step} ({op})"
        assert layer.lengths.tolist() == [[len(row) for row in head] for head in model.held()]
        state = get_state(layer)
        if state is not None:  # as on a DynamicLayer, the per-slot state covers the columns up to its last write
            scores = state.per_slot["scores"]
            ids = view_ids(layer)
            assert torch.equal(scores.long(), ids[..., :scores.shape[-1]])
            # ... and the log-weights the whole view: -inf in its holes and on dead slots, 0 (the tokens appended
            # since the write included) on every other slot.
            assert state.log_weights.shape == ids.shape
            is_dead = torch.isin(ids, torch.tensor(sorted(dead), dtype=torch.long)) & (ids > 0)
            assert bool((state.log_weights[(ids == 0) | is_dead] == -INF).all())
            assert bool((state.log_weights[(ids > 0) & ~is_dead] == 0).all())


@pytest.mark.parametrize("heads,positions,kept", [
    ([0, 1, 0], [1, 1, 4], [[1, 3, 4], [7, 9, 10]]),  # position 1 of every head (a column no head holds), 4 of head 0
    ([0], [4], [[1, 2, 3, 4], [7, 8, 9, 10]]),  # a late slot of one head
])
def test_a_cut_after_marks_keeps_the_tokens_the_rectangular_cache_keeps(heads, positions, kept):
    """kvpress's head-wise marks, evicted for real, then kvpress's pipeline cutting an answer (keys[:, :, :n]): the
    view stays as wide as the rectangular cache, which keeps a masked slot's column, and each head keeps its tokens
    before column n. A column no head held left the view (the cut at n then kept a token of column n), and a head
    that lost a late slot showed its earlier ones a column to the right (the cut dropped its token of column n - 1)."""
    layer = PagedLayer(block_size=4)
    module = AttentionModule()
    ids = torch.arange(1, 13).view(1, 2, 6)  # head 0: tokens 1..6, head 1: 7..12, at positions 0..5
    keys = torch.stack([ids.float(), 2 * ids.float()], -1)
    layer.update(keys, -keys, {"cache_position": torch.arange(6)})
    layer.attended_by(module)
    module.masked_key_indices = (torch.zeros(len(heads), dtype=torch.long), torch.tensor(heads), torch.tensor(positions))
    assert layer.get_seq_length() == 6
    layer.keys, layer.values = layer.keys[:, :, :4], layer.values[:, :, :4]
    check_allocator(layer)  # (stores the pair written)
    assert layer.get_seq_length() == 4
    assert head_tokens(view_ids(layer)) == [kept]


@pytest.mark.parametrize("width", [4, 5])
def test_a_cut_after_marks_evicted_a_press_s_slots_keeps_the_tokens_the_rectangular_cache_keeps(width):
    """A press's slots whose positions the layer knows (tokens appended after its write, then its state stored in
    place, as KVzap does between its compactions) marked by kvpress's head-wise masking, then cut by kvpress's
    pipeline: each head keeps the tokens a DynamicCache keeps before column `width`, where the masked slot keeps its
    column. The cut counted each head's base slots as columns, so a head that lost one kept a token past the cut. (A
    state without an owner, set by hand: our presses' states refuse kvpress's marks.)"""
    module = AttentionModule()
    paged, dynamic = PagedLayer(block_size=4), DynamicLayer()
    ids = torch.tensor([[[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]])  # head 0, head 1 at positions 0..5
    keys = torch.stack([ids.float(), 2 * ids.float()], -1)
    for layer in (paged, dynamic):
        layer.update(keys[:, :, :2], -keys[:, :, :2], {"cache_position": torch.arange(2)})
        # A press's write keeping both slots of each head, then 4 tokens, then the press's state stored in place
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        set_state(layer, LayerState(torch.zeros(1, 2, 2)))
        layer.update(keys[:, :, 2:], -keys[:, :, 2:], {"cache_position": torch.arange(2, 6)})
        layer.keys, layer.values = layer.keys, layer.values
        set_state(layer, LayerState(torch.zeros(1, 2, 6)))
    paged.flush()
    assert paged.bases.tolist() == [[6, 6]]  # (stored in place: the appended slots are the press's now)
    paged.attended_by(module)
    module.masked_key_indices = (torch.tensor([0]), torch.tensor([0]), torch.tensor([3]))  # head 0's token 4
    masked = torch.zeros(1, 2, 6, dtype=torch.bool)
    masked[0, 0, 3] = True  # kvpress hides the slot, which keeps its column
    for layer in (paged, dynamic):
        layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
    check_allocator(paged)
    assert paged.get_seq_length() == dynamic.get_seq_length() == width
    assert head_tokens(view_ids(paged)) == head_tokens(view_ids(dynamic).masked_fill(masked[..., :width], 0))


def test_batch_of_different_lengths_holds_only_its_own_blocks():
    """Left-padded rows evicted at prefill: each (b, h) holds ceil(L_b / S) blocks."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(2, 3, 10, 8)
    layer.update(keys, keys, {"cache_position": torch.arange(10)})
    padding = torch.zeros(2, 3, 10)
    padding[1, :, :7] = -INF  # row 1 is a 3-token prompt left-padded to 10
    layer.drop_padding(padding)
    check_allocator(layer)
    assert layer.lengths.tolist() == [[10] * 3, [3] * 3]
    assert layer.blocks_in_use() == 3 * 3 + 3 * 1
    # The view keeps transformers' layout: the padding in front of the short row.
    torch.testing.assert_close(layer.keys[1, :, 7:], keys[1, :, 7:])
    assert bool((layer.keys[1, :, :7] == 0).all())


def test_prefill_takes_each_heads_blocks_in_a_run():
    """A prefill into an empty pool gives every head consecutive blocks, head after head (the regular layout, whose
    view is a strided tensor over the pools), and so does one after a reset (the freed blocks are handed out lowest
    first); into a pool whose free list is not one run, each free block is still taken once."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(2, 3, 10, 8)
    layer.update(keys, -keys)
    check_allocator(layer)
    assert torch.equal(layer.block_tables, torch.arange(18).view(2, 3, 3))
    assert layer._regular_region() == (0, 3)
    layer.reset()
    check_allocator(layer)
    other = torch.randn(2, 3, 9, 8)
    layer.update(other, -other)
    check_allocator(layer)
    assert torch.equal(layer.block_tables, torch.arange(18).view(2, 3, 3))
    torch.testing.assert_close(layer.keys, other)
    layer.reset()
    layer.free_blocks = [block for pair in zip(range(0, 18, 2), range(1, 18, 2)) for block in pair[::-1]]
    layer.update(other, -other)  # the free list ends ..., 17, 16: no run to take whole
    check_allocator(layer)
    torch.testing.assert_close(layer.keys, other)
    torch.testing.assert_close(layer.values, -other)


def test_bytes_held_and_reserved():
    cache = PagedKVCache(block_size=16)
    keys = torch.randn(2, 3, 40, 8)
    cache.update(keys, keys, 0)
    layer = cache.layers[0]
    per_block = 16 * (8 * 4 * 2 + 4 + 4)  # keys, values (float32), log-weight (float32), position (int32)
    assert cache.bytes_held() == 2 * 3 * math.ceil(40 / 16) * per_block
    keep = torch.zeros(2, 3, 40)
    keep[..., 20:] = -INF
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    set_state(layer, LayerState(keep))
    assert cache.bytes_held() == 2 * 3 * math.ceil(20 / 16) * per_block
    assert cache.bytes_reserved() == 2 * 3 * 3 * per_block  # freed blocks stay in the pool, reusable
    view = layer.keys.clone()
    cache.trim()
    check_allocator(layer)
    assert cache.bytes_reserved() == cache.bytes_held() == 2 * 3 * 2 * per_block
    torch.testing.assert_close(layer.keys, view)
    cache.update(keys, keys, 0)  # and the pool grows again
    check_allocator(layer)
    torch.testing.assert_close(layer.keys[..., :20, :], view)


def test_pool_grows_and_reuses_freed_blocks():
    layer = PagedLayer(block_size=2)
    keys = torch.randn(1, 1, 4, 2)
    layer.update(keys, keys)
    capacity = layer.key_blocks.shape[0]
    layer.keys = layer.keys[:, :, :1]
    layer.values = layer.values[:, :, :1]
    layer.flush()
    layer.update(keys[:, :, :3], keys[:, :, :3])
    assert layer.key_blocks.shape[0] == capacity  # the freed block was reused
    layer.update(keys, keys)
    assert layer.key_blocks.shape[0] > capacity
    check_allocator(layer)
    torch.testing.assert_close(layer.keys[0, 0], torch.cat([keys[0, 0, :1], keys[0, 0, :3], keys[0, 0]]))


@pytest.mark.parametrize("block_size", [0, -3, 1.5, True, 2**31, 2**62])
def test_block_size_must_be_a_positive_int32(block_size):
    with pytest.raises(ValueError, match=rf"PagedKVCache: block_size must be an integer in \[1, 2\*\*31\), "
                                         rf"got {block_size!r}"):
        PagedKVCache(block_size=block_size)


def test_a_layer_first_written_after_layer_0_held_tokens_is_refused():
    """A cache filled by a 2-layer model and continued by a 3-layer one of the same head shapes: its layer 2 started
    empty at position 40 while layers 0-1 held the prompt, and attended none of it, silently. A new prompt after
    reset() gives every layer the prompt: accepted."""
    from tests.models import make_tiny_llama

    two, _ = make_tiny_llama()
    three, _ = make_tiny_llama(num_hidden_layers=3, seed=1)
    cache, ids = PagedKVCache(), torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        two(ids, past_key_values=cache)
        with pytest.raises(ValueError, match=r"PagedKVCache: layer 2 is first written by a pass of 3 tokens, while "
                                             r"layer 0 holds 40 earlier tokens it never received"):
            three(ids[:, :3], past_key_values=cache)
        assert len(cache.layers) == 2
        cache.reset()
        three(ids, past_key_values=cache)
    assert [cache.get_seq_length(layer) for layer in range(3)] == [40, 40, 40]
    stage = PagedKVCache()  # a pipeline stage's cache: its first write is to a later layer
    keys = torch.randn(1, 2, 5, 8)
    stage.update(keys, keys, 1)
    assert stage.get_seq_length(1) == 5


def test_a_numpy_block_size_is_taken_as_an_int():
    """As the presses take numpy's integers (a sweep's np.arange): PagedKVCache(block_size=np.int64(4)) was refused."""
    cache = PagedKVCache(block_size=np.int64(4))
    keys = torch.randn(1, 2, 6, 8)
    cache.update(keys, keys, 0)
    assert type(cache.block_size) is int and cache.layers[0].block_size == 4 and type(cache.layers[0].block_size) is int
    assert cache.layers[0].blocks_in_use() == 2 * 2  # 6 slots of each of 2 heads in blocks of 4


def test_write_of_the_wrong_shape():
    layer = PagedLayer()
    keys = torch.randn(1, 2, 5, 4)
    layer.update(keys, keys)
    layer.keys, layer.values = torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)
    with pytest.raises(ValueError, match=r"PagedKVCache: a press wrote keys of shape \(1, 3, 5, 4\) to a layer of "
                                         r"\(1, 2\)"):
        layer.flush()


def test_keys_and_values_of_two_dtypes_are_held_in_the_wider_or_refused_as_they_came():
    """torch.autocast leaves float32 keys beside bfloat16 values: both are stored in float32 (values exactly). Values
    wider than a float16 layer's pools are refused naming the dtype passed, not one they were promoted to."""
    cache, keys = PagedKVCache(block_size=4), torch.randn(1, 2, 5, 8)
    values = torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    cache.update(keys, values, 0)
    assert cache.layers[0].value_blocks.dtype == torch.float32
    assert torch.equal(cache.layers[0].values, values.float())
    half = PagedKVCache(block_size=4)
    half.update(keys.half(), keys.half(), 0)
    with pytest.raises(ValueError, match=r"expected value states of head dim 8, torch.float16 on cpu \(the layer's "
                                         r"pool\), got \(1, 2, 5, 8\), torch.float32 on cpu"):
        half.update(keys.half(), keys, 0)


@pytest.mark.parametrize("states,refused", [
    (torch.randn(1, 2, 5, 4), r"head dim 8, torch.float32 on cpu \(the layer's pool\), got \(1, 2, 5, 4\)"),
    (torch.randn(1, 2, 5, 8, dtype=torch.bfloat16), r"head dim 8, torch.float32 on cpu .* torch.bfloat16 on cpu"),
    (torch.randn(1, 2, 5), r"\(batch, kv heads, tokens, head dim ≥ 1\), got \(1, 2, 5\)"),
    (torch.randn(1, 2, 5, 0), r"\(batch, kv heads, tokens, head dim ≥ 1\), got \(1, 2, 5, 0\)"),
])
def test_an_append_of_other_states_is_refused_and_leaves_the_layer_as_it_was(states, refused):
    """Another model's pass over the cache (another head dim or dtype) failed inside index_copy_ after the lengths had
    grown: the layer then stood for tokens never written, and the first model's next pass attended them. States
    without a head dim (3-d), or of head dim 0, failed the same way, in index_copy_ or a reshape."""
    cache, keys = PagedKVCache(block_size=4), torch.randn(1, 2, 7, 8)
    cache.update(keys, -keys, 0)
    with pytest.raises(ValueError, match=rf"PagedKVCache: expected key states of {refused}"):
        cache.update(states, states, 0)
    assert cache.get_seq_length(0) == 7
    more = torch.randn(1, 2, 2, 8)
    cache.update(more, -more, 0)
    assert torch.equal(cache.layers[0].keys, torch.cat([keys, more], dim=2))


ONE_D = "expected batch rows as a 1-D index, got shape "


@pytest.mark.parametrize("method, argument, error, message", [
    ("batch_select_indices", torch.tensor([[1, 2]]), IndexError, ONE_D + r"\(1, 2\)"),
    ("batch_select_indices", 1, IndexError, ONE_D + r"\(\)"),
    ("reorder_cache", torch.tensor([0, 3]), IndexError, r"batch rows \[0, 3\] asked of a batch of 3"),
    ("reorder_cache", torch.tensor([0.0, 1.0]), TypeError, r"expected integer batch rows \(a beam index\), got torch.float32"),
], ids=["2-D", "0-D", "out of range", "float"])
def test_batch_rows_a_rectangular_cache_would_not_select_are_refused(method, argument, error, message):
    """A 2-D index kept the rows it named, flattened, where a DynamicCache's keys[index] grows a dimension; each
    refusal leaves every row and block where it was."""
    cache, keys = PagedKVCache(block_size=4), torch.randn(3, 2, 5, 8)
    cache.update(keys, -keys, 0)
    with pytest.raises(error, match=f"PagedKVCache: {message}"):
        getattr(cache, method)(argument)
    assert torch.equal(cache.layers[0].keys, keys)
    assert cache.layers[0].blocks_in_use() == 3 * 2 * 2


@pytest.mark.parametrize("value_shape", [(1, 2, 8, 8), (1, 1, 6, 8)], ids=["more tokens", "fewer heads"])
def test_values_of_another_shape_than_the_keys_are_refused_and_leave_the_layer_as_it_was(value_shape):
    """Values of other tokens or heads than the keys failed inside index_copy_ after the keys were written and the
    lengths had grown: the layer then held tokens whose values, log-weights and positions were stale."""
    cache, keys = PagedKVCache(block_size=4), torch.randn(1, 2, 5, 8)
    cache.update(keys, -keys, 0)
    with pytest.raises(ValueError, match=re.escape("PagedKVCache: expected value states of the keys' (batch, kv heads, "
                                                   f"tokens) (1, 2, 6), got {value_shape}")):
        cache.update(torch.randn(1, 2, 6, 8), torch.randn(*value_shape), 0)
    more = torch.randn(1, 2, 2, 8)
    cache.update(more, -more, 0)
    assert torch.equal(cache.layers[0].keys, torch.cat([keys, more], dim=2))
    assert torch.equal(cache.layers[0].values, -cache.layers[0].keys)


def test_a_write_back_of_another_head_dim_is_refused_naming_the_pool():
    """A press writing values of another head dim than the layer's pool (a DynamicLayer stores any) failed in a
    broadcast inside the copy, naming neither the cache nor the shapes."""
    layer = PagedLayer(block_size=3)
    keys = torch.randn(2, 2, 7, 4)
    layer.update(keys, -keys)
    layer.keys, layer.values = layer.keys[:, :, :4], torch.randn(2, 2, 4, 6)
    with pytest.raises(ValueError, match=re.escape("PagedKVCache: values of shape (2, 2, 4, 6) were written to a "
                                                   "layer whose pool holds (batch, kv heads, tokens, 4) values")):
        layer.flush()
    assert torch.equal(layer.keys, keys)


def test_a_block_too_large_to_allocate_is_refused_naming_the_block_size():
    """block_size=2**40 was accepted, and the first append failed in the allocator, naming neither the cache nor
    the block size. The largest block size allowed, with 1024-dim heads: 16 TiB per block."""
    keys, block_size = torch.randn(1, 1, 1, 1024), 2**31 - 1
    # keys, values, a float32 log-weight and an int32 position per slot
    block_bytes = block_size * (1024 + 1024 + 1 + 1) * 4
    with pytest.raises(RuntimeError, match=rf"PagedKVCache: cannot add 1 blocks of block_size={block_size} slots "
                                           rf"\({block_bytes} bytes\) to the layer's pools on cpu"):
        PagedKVCache(block_size=block_size).update(keys, keys, 0)


def test_a_pool_that_cannot_grow_leaves_the_layer_as_it_was(monkeypatch):
    """A pool that could not grow (out of memory) failed after the lengths had grown and blocks had changed hands:
    the layer then stood for slots in no block. Refused naming the cache, it goes on once memory allows."""
    cache, keys = PagedKVCache(block_size=4), torch.randn(2, 2, 7, 8)
    cache.update(keys, -keys, 0)
    more = torch.randn(2, 2, 10, 8)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (as the allocator says)")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "new_zeros", out_of_memory)
        with pytest.raises(RuntimeError, match=r"PagedKVCache: cannot add \d+ blocks of block_size=4 slots"):
            cache.update(more, -more, 0)
        with pytest.raises(RuntimeError, match=r"PagedKVCache: cannot add \d+ blocks of block_size=4 slots"):
            cache.batch_repeat_interleave(2)
    assert torch.equal(cache.layers[0].keys, keys)
    cache.update(more, -more, 0)
    cache.batch_repeat_interleave(2)
    expected = torch.cat([keys, more], dim=2).repeat_interleave(2, dim=0)
    assert torch.equal(cache.layers[0].keys, expected)
    assert torch.equal(cache.layers[0].values, -expected)


def test_appends_without_cache_position_follow_the_tokens_appended():
    """transformers 5.17 gives no cache_position: each token is placed after the last one appended (the positions
    kvpress's head-wise presses mark), a prompt over an emptied layer from 0 as in a new cache, and a press's rewrite
    (its slots' positions unknown, -1) does not move that count back."""
    cache = PagedKVCache(block_size=4)
    keys = torch.randn(1, 2, 6, 8)
    cache.update(keys, keys, 0)
    cache.update(keys[:, :, :2], keys[:, :, :2], 0)
    layer = cache.layers[0]
    assert torch.equal(layer._slot_positions(), torch.arange(8).expand(1, 2, 8))
    layer.keys, layer.values = layer.keys[:, :, :5].clone(), layer.values[:, :, :5].clone()
    set_state(layer, LayerState(torch.zeros(1, 2, 5)))  # a press merged 8 tokens into 5 slots
    cache.update(keys[:, :, :1], keys[:, :, :1], 0)
    assert torch.equal(layer._slot_positions()[..., -1], torch.full((1, 2), 8))
    layer.reset()
    cache.update(keys[:, :, :3], keys[:, :, :3], 0)
    assert torch.equal(layer._slot_positions(), torch.arange(3).expand(1, 2, 3))


def test_appends_without_cache_position_after_a_cut_follow_the_tokens_kept():
    """A cut (prompt lookup's crop, kvpress's pipeline dropping an answer) removes its tokens from the count too: the
    next token takes the position of the first one cut, as transformers 4's cache_position would give it."""
    cache = PagedKVCache(block_size=4)
    keys = torch.randn(1, 2, 9, 8)
    cache.update(keys[:, :, :6], keys[:, :, :6], 0)
    cache.update(keys[:, :, 6:9], keys[:, :, 6:9], 0)
    cache.crop(7)
    cache.update(keys[:, :, :2], keys[:, :, :2], 0)
    layer = cache.layers[0]
    assert torch.equal(layer._slot_positions(), torch.arange(9).expand(1, 2, 9))


class LeftPadded(LayerState):
    left_padded = True


def left_padded_write(per_slot: dict | None = None) -> tuple[PagedKVCache, PagedLayer, torch.Tensor, torch.Tensor]:
    """A paged cache of 2 rows x 2 heads x 6 columns (blocks of 2) written by a press that left-pads (a padded batch
    compressed row by row): row 1 keeps its last 2 slots after 4 of padding. (cache, its layer, the keys written,
    the log-weights)."""
    cache = PagedKVCache(block_size=2)
    keys = torch.randn(2, 2, 6, 4)
    cache.update(keys, -keys, 0)
    layer = cache.layers[0]
    log_weights = torch.zeros(2, 2, 6)
    log_weights[1, :, :4] = -INF
    written = keys.masked_fill(torch.isinf(log_weights).unsqueeze(-1), 0)
    layer.keys, layer.values = written.clone(), -written.clone()
    set_state(layer, LeftPadded(log_weights.clone(), per_slot or {}))
    return cache, layer, written, log_weights


def test_a_left_padded_state_reads_back_as_written():
    """A press that left-pads (each row's slots at the right, after -inf padding) reads its write back as written, and
    the tokens appended after it, as a rectangular cache holds them; a cut keeps each head's columns before it. The
    padding is not stored."""
    cache, layer, written, log_weights = left_padded_write({"scores": torch.arange(24.0).view(2, 2, 6)})
    check_allocator(layer)
    assert layer.lengths.tolist() == [[6, 6], [2, 2]]
    torch.testing.assert_close(layer.keys, written)
    state = get_state(layer)
    torch.testing.assert_close(state.log_weights, log_weights)
    torch.testing.assert_close(state.per_slot["scores"][~torch.isinf(log_weights)],
                               torch.arange(24.0).view(2, 2, 6)[~torch.isinf(log_weights)])
    new = torch.randn(2, 2, 3, 4)
    cache.update(new, -new, 0)
    torch.testing.assert_close(layer.keys, torch.cat([written, new], dim=2))
    torch.testing.assert_close(layer.values, -torch.cat([written, new], dim=2))
    layer.keys, layer.values = layer.keys[:, :, :5], layer.values[:, :, :5]
    layer.flush()
    check_allocator(layer)
    torch.testing.assert_close(layer.keys, written[:, :, :5])
    assert layer.lengths.tolist() == [[5, 5], [1, 1]]


def test_a_head_shortened_by_exactly_one_block_gives_that_block_back():
    """Only a head shortened by *less* than a block keeps its emptied block: one cut by a whole block (or more)
    holds ceil(length / block_size) blocks, and bytes_held says so."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(1, 2, 8, 8)
    layer.update(keys, -keys, {"cache_position": torch.arange(8)})
    log_weights = torch.zeros(1, 2, 8)
    log_weights[0, 0, 4:] = -INF  # head 0 keeps 4 of 8 (shortened by exactly one block)
    log_weights[0, 1, 3:] = -INF  # head 1 keeps 3 of 8
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    set_state(layer, LayerState(log_weights))
    layer.flush()
    assert layer.lengths.tolist() == [[4, 3]]
    assert layer.blocks_in_use() == math.ceil(4 / 4) + math.ceil(3 / 4) == 2
    assert layer.bytes_held() == 2 * layer._block_bytes()


def test_a_cut_after_dropping_the_longest_row_of_a_left_padded_state_keeps_the_columns_before_it():
    """A left-padded press state (row 1: 4 columns of padding, then 2 slots), then row 0 dropped
    (batch_select_indices): the view stays 6 wide, as the rectangular cache's row 1 does. A cut keys[:, :, :5] keeps
    the rectangular cache's columns 0..4 of that row: its padding and its first slot only."""
    cache, layer, written, _ = left_padded_write()
    layer.flush()
    cache.batch_select_indices(torch.tensor([1]))
    rect = written[1:]  # the rectangular cache's row 1 (a DynamicLayer keeps every column)
    torch.testing.assert_close(layer.keys, rect)
    layer.keys, layer.values = layer.keys[:, :, :5], layer.values[:, :, :5]
    layer.flush()
    assert layer.lengths.tolist() == [[1, 1]]
    assert layer.get_seq_length() == 5
    torch.testing.assert_close(layer.keys, rect[:, :, :5])


def test_a_merging_write_after_a_press_owned_its_appended_slots_drops_their_dead_slots():
    """KVzap's paged step marks slots -inf in the pools and calls own_appended_slots(): the layer may then hold dead
    slots, so a later write of a press that keeps every slot it is given (keeps_held_slots) must still drop the
    columns whose log-weight is -inf, as the rectangular cache's compaction does."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(1, 2, 6, 8)
    layer.update(keys[:, :, :4], -keys[:, :, :4], {"cache_position": torch.arange(4)})
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    set_state(layer, LayerState(torch.zeros(1, 2, 4), {"scores": torch.zeros(1, 2, 4)}))
    layer.update(keys[:, :, 4:], -keys[:, :, 4:], {"cache_position": torch.arange(4, 6)})
    # the press decides slot 1 of every head in the pools (as kvzap_paged_step does) and owns the appended slots
    index = layer._flat_slots(torch.ones(1, 2, 1, dtype=torch.long)).flatten()
    layer.slot_blocks["log_weights"].view(-1)[index] = -INF
    layer.own_appended_slots()
    state = LayerState(torch.zeros(1, 2, 6).index_fill(-1, torch.tensor([1]), -INF), {"scores": torch.zeros(1, 2, 6)})
    state.keeps_held_slots = True
    view = layer.keys.clone()
    layer.keys, layer.values = view, -view
    set_state(layer, state)
    layer.flush()
    assert layer.lengths.tolist() == [[5, 5]]
    torch.testing.assert_close(layer.keys, keys[:, :, [0, 2, 3, 4, 5]])


def test_marks_evict_only_slots_whose_position_the_layer_knows():
    """After a rewrite without positions (a kvpress press's compression: positions -1), kvpress's head-wise marks of
    positions 0 and 4 evict only the appended token at position 4, never the rewritten slots of unknown position."""

    class Module:
        masked_key_indices = None

    layer, module = PagedLayer(block_size=4), Module()
    keys = torch.randn(1, 2, 6, 8)
    layer.update(keys[:, :, :4], -keys[:, :, :4], {"cache_position": torch.arange(4)})
    layer.keys, layer.values = layer.keys[:, :, 1:].clone(), layer.values[:, :, 1:].clone()  # 3 slots, positions -1
    layer.flush()
    layer.update(keys[:, :, 4:], -keys[:, :, 4:], {"cache_position": torch.arange(4, 6)})
    layer.attended_by(module)
    module.masked_key_indices = (torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([0, 4]))
    layer.flush()
    assert layer.lengths.tolist() == [[4, 5]]
    held = layer.keys[0, 0][layer.keys[0, 0].abs().sum(-1) > 0]
    torch.testing.assert_close(held, keys[0, 0, [1, 2, 3, 5]])


def test_marks_are_evicted_by_the_layer_the_module_last_attended_only():
    """Two paged layers read by one attention module (a cache and a copy of it, two conversations): the marks a
    head-wise press leaves after a pass over `current` index its slots; `other` flushing first (its get_seq_length)
    must neither evict them from its own slots nor consume them."""

    class Module:
        masked_key_indices = None

    module = Module()
    keys = torch.randn(1, 2, 6, 8)
    other, current = PagedLayer(block_size=4), PagedLayer(block_size=4)
    for layer in (other, current):
        layer.update(keys, -keys, {"cache_position": torch.arange(6)})
    other.attended_by(module)
    current.attended_by(module)  # the pass over `current` that leaves the marks
    module.masked_key_indices = (torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))
    assert other.get_seq_length() == 6 and other.lengths.tolist() == [[6, 6]]
    torch.testing.assert_close(other.keys, keys)
    current.flush()
    assert current.lengths.tolist() == [[6, 5]]
    torch.testing.assert_close(current.keys[0, 1, 1:], keys[0, 1, [0, 1, 3, 4, 5]])


# ---------------------------------------------------------------------------------------------------------------------
# Gaps a mutation round found: each test compares with a DynamicLayer holding the same history (kvpress's masked slots
# keep their columns there) or with a property stated in PagedLayer's docstrings.


def test_a_layer_whose_every_slot_marks_evicted_still_stands_for_its_tokens():
    """kvpress's head-wise marks evicting every slot leave a layer of no slot that still stands for its tokens (the
    rectangular cache keeps the masked columns): the next append is not a new prompt; it continues at the next column
    and position, as a DynamicLayer's would."""
    layer, dynamic, module = PagedLayer(block_size=4), DynamicLayer(), AttentionModule()
    keys = torch.randn(1, 2, 4, 8)
    for each in (layer, dynamic):
        each.update(keys[:, :, :3], -keys[:, :, :3], {"cache_position": torch.arange(3)})
    layer.attended_by(module)
    module.masked_key_indices = (torch.zeros(6, dtype=torch.long), torch.tensor([0, 0, 0, 1, 1, 1]),
                                 torch.tensor([0, 1, 2, 0, 1, 2]))
    layer.flush()
    assert layer.lengths.tolist() == [[0, 0]] and layer.get_seq_length() == 3
    for each in (layer, dynamic):
        each.update(keys[:, :, 3:], -keys[:, :, 3:])  # no cache_position (transformers 5.17)
    assert layer.get_seq_length() == dynamic.get_seq_length() == 4
    assert layer.take_prompt_states() is None  # not a prefill
    assert layer._slot_positions().tolist() == [[[3], [3]]]
    torch.testing.assert_close(layer.keys[..., -1:, :], keys[:, :, 3:])


def test_an_append_without_cache_position_after_ones_with_it_follows_the_last_position():
    """Positions given on the device (transformers 4's cache_position), then an append without one (5.17): the new
    tokens follow the last position held, as the tokens a DynamicLayer would place there."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(1, 2, 7, 8)
    layer.update(keys[:, :, :5], -keys[:, :, :5], {"cache_position": torch.arange(5)})
    layer.update(keys[:, :, 5:], -keys[:, :, 5:])
    assert torch.equal(layer._slot_positions(), torch.arange(7).expand(1, 2, 7))


def test_an_append_without_cache_position_after_a_cut_of_ones_with_it_follows_the_tokens_kept():
    """Positions given on the device, a cut, then an append without one: the new token takes the first cut one's
    position, not one after the cut tokens' positions, which their freed slots still hold."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(1, 2, 11, 8)
    layer.update(keys[:, :, :6], -keys[:, :, :6], {"cache_position": torch.arange(6)})
    layer.update(keys[:, :, 6:10], -keys[:, :, 6:10], {"cache_position": torch.arange(6, 10)})
    layer.crop(5)
    layer.update(keys[:, :, 10:], -keys[:, :, 10:])
    assert torch.equal(layer._slot_positions(), torch.arange(6).expand(1, 2, 6))


def test_a_reset_or_a_new_prompt_forgets_the_padding_the_last_prefill_dropped():
    """The padding every row of a prefill had is counted among the tokens held (``padding_dropped``) until the layer
    is emptied: a reset cache counts no token, and a new prompt over it counts its own tokens, as a DynamicCache."""
    cache = PagedKVCache(block_size=4)
    keys = torch.randn(2, 2, 6, 8)
    cache.update(keys, -keys, 0)
    padding = torch.zeros(2, 2, 6)
    padding[:, :, :2] = -INF  # both rows padded by 2, row 1 by 3
    padding[1, :, 2] = -INF
    cache.layers[0].drop_padding(padding)
    assert cache.get_seq_length() == 6  # 4 columns held + the 2 every row dropped
    cache.reset()
    assert cache.get_seq_length() == 0
    cache.update(keys[:, :, :3], -keys[:, :, :3], 0)
    assert cache.get_seq_length() == 3


@pytest.mark.parametrize("count", [1, 3, 5])
def test_last_slots_reads_each_heads_last_slots_or_none_when_a_head_holds_fewer(count):
    """last_slots(name, count): the per-slot pool at each head's last `count` slots (heads of different lengths), None
    only when a head holds fewer than `count`; a head holding exactly `count` is read whole."""
    layer = PagedLayer(block_size=2)
    keys = torch.randn(1, 2, 7, 8)
    layer.update(keys, -keys, {"cache_position": torch.arange(7)})
    log_weights = torch.zeros(1, 2, 7)
    log_weights[0, 1, :2] = -INF  # head 1 keeps its last 5 tokens, head 0 all 7
    layer.keys, layer.values = layer.keys, layer.values
    set_state(layer, LayerState(log_weights))  # no positions after a press's write: append tokens that have them
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), {"cache_position": torch.arange(7, 10)})
    assert layer.lengths.tolist() == [[10, 8]]
    positions = layer.last_slots("token_positions", count)
    expected = torch.tensor([[list(range(10 - count, 10))] * 2], dtype=torch.int32)
    expected[expected < 7] = -1  # the press's slots: positions unknown
    assert torch.equal(positions.cpu(), expected)
    assert layer.last_slots("token_positions", 8) is not None
    assert layer.last_slots("token_positions", 9) is None


@pytest.mark.parametrize("how", ["cut", "press"])
def test_heads_of_one_length_shortened_by_exactly_one_block_give_that_block_back(how):
    """As a single head: heads of one length all shortened by a whole block (a cut, a press keeping as many slots in
    every head) hold ceil(length / block_size) blocks each; only a shortening by less than a block keeps one."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(2, 2, 8, 8)
    layer.update(keys, -keys, {"cache_position": torch.arange(8)})
    if how == "cut":
        layer.keys, layer.values = layer.keys[:, :, :4], layer.values[:, :, :4]
    else:
        layer.keys, layer.values = layer.keys[:, :, 2:6].clone(), layer.values[:, :, 2:6].clone()
        set_state(layer, LayerState(torch.zeros(2, 2, 4)))
    layer.flush()
    check_allocator(layer)
    assert layer.lengths.tolist() == [[4, 4], [4, 4]]
    assert layer.blocks_in_use() == 2 * 2 * 1
    torch.testing.assert_close(layer.keys, keys[:, :, :4] if how == "cut" else keys[:, :, 2:6])
    layer.keys, layer.values = layer.keys[:, :, :3], layer.values[:, :, :3]  # less than a block: the block stays
    layer.flush()
    assert layer.blocks_in_use() == 2 * 2 * 1


def test_a_cut_after_marks_evicted_a_press_s_slots_and_a_reorder_keeps_each_rows_tokens_before_it():
    """As test_a_cut_after_marks_evicted_a_press_s_slots_keeps_the_tokens_the_rectangular_cache_keeps, with beam
    search's reorder between the marks and the cut: the columns at which each row's base slots stand move with the
    row, and each row keeps the tokens the rectangular cache (its rows reordered, the masked slot keeping its column)
    holds before the cut."""
    module, layer = AttentionModule(), PagedLayer(block_size=4)
    ids = torch.arange(1, 25).view(2, 2, 6)  # (row, head) at positions 0..5
    keys = torch.stack([ids.float(), 2 * ids.float()], -1)
    layer.update(keys[:, :, :2], -keys[:, :, :2], {"cache_position": torch.arange(2)})
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    set_state(layer, LayerState(torch.zeros(2, 2, 2)))
    layer.update(keys[:, :, 2:], -keys[:, :, 2:], {"cache_position": torch.arange(2, 6)})
    layer.keys, layer.values = layer.keys, layer.values
    set_state(layer, LayerState(torch.zeros(2, 2, 6)))  # stored in place: every slot is the press's, positions known
    layer.attended_by(module)
    module.masked_key_indices = (torch.tensor([0]), torch.tensor([0]), torch.tensor([3]))  # row 0, head 0: token 4
    layer.reorder_cache(torch.tensor([1, 0]))
    layer.keys, layer.values = layer.keys[:, :, :4], layer.values[:, :, :4]
    check_allocator(layer)
    rect = ids[[1, 0], :, :4].clone()  # the rectangular cache reordered, then cut
    rect[1, 0, 3] = 0  # its masked slot (row 0 before the reorder)
    assert layer.get_seq_length() == 4
    assert head_tokens(view_ids(layer)) == head_tokens(rect)


def test_heads_of_one_length_but_different_bases_keep_the_rectangular_layout():
    """A press keeps 3 slots in head 0 and 2 in head 1, a token is appended, and kvpress's marks evict head 0's: both
    heads hold 3 slots, but the rectangular cache (compacted to the longest head, the masked slot keeping its column)
    is 4 wide, head 1's appended token at column 3 after a column of padding. Equal lengths alone do not make the
    view unpadded. (A state without an owner, set by hand: our presses' states refuse kvpress's marks.)"""
    module, layer = AttentionModule(), PagedLayer(block_size=2)
    ids = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    keys = torch.stack([ids.float(), 2 * ids.float()], -1)
    layer.update(keys, -keys, {"cache_position": torch.arange(3)})
    log_weights = torch.zeros(1, 2, 3)
    log_weights[0, 1, 2] = -INF  # head 1 keeps tokens 4, 5
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    set_state(layer, LayerState(log_weights))
    new = torch.tensor([[[7], [8]]])
    layer.update(torch.stack([new.float(), 2 * new.float()], -1), -torch.stack([new.float(), 2 * new.float()], -1),
                 {"cache_position": torch.tensor([3])})
    layer.attended_by(module)
    module.masked_key_indices = (torch.tensor([0]), torch.tensor([0]), torch.tensor([3]))  # head 0's token 7
    layer.flush()
    assert layer.lengths.tolist() == [[3, 3]]
    rect = torch.tensor([[[1, 2, 3, 0], [4, 5, 0, 8]]])  # token 7 masked in its column
    assert layer.get_seq_length() == 4
    assert torch.equal(view_ids(layer), rect)


@pytest.mark.parametrize("state", [True, False], ids=["press", "kvpress compression"])
def test_a_rewrite_after_a_padded_prefill_counts_only_what_it_wrote(state):
    """The padding every row of the prefill dropped is counted among the tokens held only until something rewrites
    the layer: then the cache holds as many tokens as the width written (a DynamicCache holds the written tensor)."""
    cache = PagedKVCache(block_size=4)
    keys = torch.randn(2, 2, 8, 8)
    cache.update(keys, -keys, 0)
    layer = cache.layers[0]
    padding = torch.zeros(2, 2, 8)
    padding[:, :, :3] = -INF  # every row padded by 3
    layer.drop_padding(padding)
    assert cache.get_seq_length() == 8
    layer.keys, layer.values = layer.keys[:, :, 1:4].clone(), layer.values[:, :, 1:4].clone()
    if state:
        set_state(layer, LayerState(torch.zeros(2, 2, 3)))
    layer.flush()
    assert cache.get_seq_length() == 3
    torch.testing.assert_close(layer.keys, keys[:, :, 4:7])


def test_a_state_stored_in_place_that_does_not_left_pad_shows_its_slots_from_column_0():
    """After a left-padded press's write (row 1's slots at the right), a state written in place over the view's own
    keys and values by a press that does not left-pad: the view is laid out for that state (each head's slots from
    column 0, as compact_to_longest_head lays them out), and its state reads back at those columns."""
    cache, layer, written, log_weights = left_padded_write()
    layer.keys, layer.values = layer.keys, layer.values
    set_state(layer, LayerState(torch.zeros(2, 2, 6).masked_fill(torch.isinf(log_weights), -INF)))
    layer.flush()
    assert layer.lengths.tolist() == [[6, 6], [2, 2]]
    expected = written.clone()
    expected[1] = 0
    expected[1, :, :2] = written[1, :, 4:]
    torch.testing.assert_close(layer.keys, expected)
    assert bool((get_state(layer).log_weights[1, :, :2] == 0).all())
    assert bool((get_state(layer).log_weights[1, :, 2:] == -INF).all())


def test_a_strided_selection_of_the_view_is_stored_as_tokens_not_taken_for_a_cut():
    """keys[:, :, ::2] starts where the view does and is narrower, but is no cut keys[:, :, :n]: each head holds the
    tokens written, as a DynamicLayer given that tensor."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(1, 2, 9, 8)
    layer.update(keys, -keys, {"cache_position": torch.arange(9)})
    layer.keys, layer.values = layer.keys[:, :, ::2], layer.values[:, :, ::2]
    layer.flush()
    check_allocator(layer)
    assert layer.get_seq_length() == 5
    torch.testing.assert_close(layer.keys, keys[:, :, ::2])
    torch.testing.assert_close(layer.values, -keys[:, :, ::2])


def test_a_press_handing_back_the_views_keys_with_new_values_stores_its_values():
    """A press that keeps the view's own keys but writes new values (a merge of values only) under its state: the
    layer holds the values written, not the view's, as a DynamicLayer given them."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(1, 2, 6, 8)
    layer.update(keys, -keys, {"cache_position": torch.arange(6)})
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    set_state(layer, LayerState(torch.zeros(1, 2, 6)))
    view_keys = layer.keys
    new_values = 3 * layer.values
    layer.keys, layer.values = view_keys, new_values
    set_state(layer, LayerState(torch.zeros(1, 2, 6)))
    layer.flush()
    torch.testing.assert_close(layer.keys, keys)
    torch.testing.assert_close(layer.values, -3 * keys)


@pytest.mark.parametrize("batch,heads,width", [(1, 1, 9), (2, 2, 40)])
def test_a_press_writing_a_slice_of_the_view_itself_stores_it(batch, heads, width):
    """On a regular layout the view shares the pools' memory: a press handing back keys[:, :, 1:] of it, uncloned,
    with its state (every slot kept), overlaps the slots it is stored into. The layer holds what was written."""
    layer = PagedLayer(block_size=4)
    keys = torch.randn(batch, heads, width, 8)
    layer.update(keys, -keys, {"cache_position": torch.arange(width)})
    layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
    set_state(layer, LayerState(torch.zeros(batch, heads, width - 1)))
    layer.flush()
    check_allocator(layer)
    torch.testing.assert_close(layer.keys, keys[:, :, 1:])
    torch.testing.assert_close(layer.values, -keys[:, :, 1:])
