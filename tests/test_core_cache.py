"""Per-row KV-cache rollback: after verifying a tree and committing a per-row path, the
committed cache equals a fresh prefill of the committed tokens (same left padding)."""

from __future__ import annotations

import torch

from mmspec.models import HFTarget
from mmspec.types import CommitInfo

from conftest import left_padded


def committed_kv(target: HFTarget, layer: int = 0):
    r = target.runner.kv
    out = []
    for b in range(r.length.shape[0]):
        keep = r.prefix_valid[b, : r.length_host[b]].clone()
        idx = keep.nonzero().squeeze(1)
        out.append((r.keys[layer][b][:, idx], r.values[layer][b][:, idx]))
    return out


@torch.no_grad()
def test_tree_commit_equals_fresh_prefill(target):
    ids, mask = left_padded([6, 3, 5])
    t = HFTarget(target)
    t.prefill(ids, mask, {}, max_new_tokens=16, max_draft_nodes=6)
    # Root + a 6-node tree:   0 -> {1, 2}; 1 -> {3}; 2 -> {4}; 3 -> {5}; 4 -> {6}
    parents = torch.tensor([[-1, -1, 0, 1, 2, 3]]).expand(3, 6)
    tokens = torch.randint(3, 40, (3, 7), generator=torch.Generator().manual_seed(1))
    t.verify(tokens, parents)
    # Per row: row 0 keeps path 0-1-3-5, row 1 keeps only the root, row 2 keeps 0-2-4.
    path = torch.tensor([[0, 1, 3, 5, 5, 5, 5], [0, 0, 0, 0, 0, 0, 0], [0, 2, 4, 4, 4, 4, 4]])
    n = torch.tensor([3, 0, 2])
    t.commit(CommitInfo(path=path, num_accepted=n, accepted_tokens=torch.zeros(3, 6, dtype=torch.long),
                        next_tokens=torch.zeros(3, dtype=torch.long), is_chain=False, num_accepted_list=n.tolist()))
    fresh = HFTarget(target)
    for b in range(3):
        kept = tokens[b, path[b, : n[b] + 1]]
        row_ids = torch.cat([ids[b][mask[b].bool()], kept]).unsqueeze(0)
        fresh.prefill(row_ids, torch.ones_like(row_ids), {}, max_new_tokens=1, max_draft_nodes=0)
        k_ref = fresh.runner.kv.keys[1][0, :, : row_ids.shape[1]]
        k_got = committed_kv(t, layer=1)[b][0]
        assert k_got.shape == k_ref.shape
        torch.testing.assert_close(k_got, k_ref, rtol=1e-10, atol=1e-10)
    # And the next forward continues at the right logical positions: compare logits.
    nxt = torch.tensor([[7], [8], [9]])
    got = t.verify(nxt, None).logits[:, -1]
    for b in range(3):
        kept = tokens[b, path[b, : n[b] + 1]]
        row_ids = torch.cat([ids[b][mask[b].bool()], kept, nxt[b]]).unsqueeze(0)
        ref = target(input_ids=row_ids).logits[0, -1]
        torch.testing.assert_close(got[b], ref, rtol=1e-9, atol=1e-9)


@torch.no_grad()
def test_select_rows_keeps_the_right_rows(target):
    ids, mask = left_padded([6, 3, 5])
    t = HFTarget(target)
    t.prefill(ids, mask, {}, max_new_tokens=8, max_draft_nodes=2)
    t.select_rows(torch.tensor([2, 0]), [2, 0])
    got = t.verify(torch.tensor([[11], [12]]), None).logits[:, -1]
    for i, b in enumerate([2, 0]):
        row = torch.cat([ids[b][mask[b].bool()], torch.tensor([11 + i])]).unsqueeze(0)
        torch.testing.assert_close(got[i], target(input_ids=row).logits[0, -1], rtol=1e-9, atol=1e-9)


def test_mask_free_chain_step_records_its_position_at_the_slot_it_writes():
    """A chain step that sees the whole uncommitted region (T > 0 tokens already in it) writes
    its keys at slot length + T; its logical position must be recorded at that slot (sliding-
    window masks read slot positions), and the committed slots must keep theirs."""
    from mmspec.ragged import RaggedKV

    B, L = 2, 5
    kv = RaggedKV(1, torch.ones(B, L, dtype=torch.long), 32)
    kv.plan_prefill(torch.ones(B, L, dtype=torch.long))
    kv.update(0, torch.zeros(B, 1, L, 2), torch.zeros(B, 1, L, 2))
    kv.scrub_padding()
    before = kv.slot_pos[:, :L].clone()
    for T in range(3):  # three chain tokens, each seeing the region before it
        vis = torch.ones(B, 1, T + 1, dtype=torch.bool)
        att = kv.plan(torch.full((B, 1), T), vis, T, sees_region=True)
        assert att.full and kv.write_slice == (L + T, L + T + 1)
        k, _ = kv.update(0, torch.full((B, 1, 1, 2), float(T + 1)), torch.zeros(B, 1, 1, 2))
        assert torch.equal(k[:, 0, L + T], torch.full((B, 2), float(T + 1)))
        assert torch.equal(att.q_pos, torch.full((B, 1), L + T))
        assert torch.equal(kv.slot_pos[:, L + T], torch.full((B,), L + T)), (T, kv.slot_pos[:, : L + 3])
    assert torch.equal(kv.slot_pos[:, :L], before)
    # the dense view of the last step (what a sliding-window mask starts from) sees every slot
    assert bool(att.dense().all()) and att.dense().shape == (B, 1, L + 3)


def test_ragged_select_rows_compacts_in_place_like_a_gather():
    """Rows leaving the batch: the KV buffers are compacted in place (kept rows moved down, the
    buffers narrowed) and hold exactly what a gather of the kept rows holds, for drops at the
    front, the middle and the end, and down to no row; rows out of order are gathered. The
    store keeps working afterwards (a write, then growth past the capacity)."""
    from mmspec.ragged import RaggedKV

    g = torch.Generator().manual_seed(0)
    for keep in ([1, 2, 3, 4], [0, 2, 4], [0, 1, 2, 3], [3], [], [4, 0, 2]):
        kv = RaggedKV(2, torch.ones(5, 3, dtype=torch.long), max_slots=400)
        keys = [torch.randn(5, 2, kv.capacity, 4, generator=g) for _ in range(2)]
        values = [torch.randn(5, 2, kv.capacity, 4, generator=g) for _ in range(2)]
        kv.keys, kv.values = [k.clone() for k in keys], [v.clone() for v in values]
        base = kv.keys[0].data_ptr()
        kv.select_rows(torch.tensor(keep, dtype=torch.long), keep)
        rows = torch.tensor(keep, dtype=torch.long)
        for layer in range(2):
            assert torch.equal(kv.keys[layer], keys[layer].index_select(0, rows))
            assert torch.equal(kv.values[layer], values[layer].index_select(0, rows))
        in_order = keep == sorted(keep)
        if keep:  # (an empty tensor has no data pointer)
            assert (kv.keys[0].data_ptr() == base) == in_order  # in place unless out of order
        assert kv.length_host == [3] * len(keep) and kv.batch_size == len(keep)
        if keep:
            kv.ensure_capacity(kv.capacity + 1)  # growth copies the narrowed buffers
            assert torch.equal(kv.keys[1][:, :, :3], keys[1].index_select(0, rows)[:, :, :3])
            assert kv.keys[1].shape[0] == len(keep)


def test_chain_plan_over_equal_rows_equals_the_general_plan():
    """A chain of Q new tokens after T region tokens, planned with the caller's chain fact
    (`sees_region=True`: the fixed-triangle path over equal, unpadded rows) and without it
    (the gather over the tree visibility): the same visibility, positions, slot positions and
    key length; the chain path writes a slice. With prompt padding, or rows of different
    lengths, the chain fact changes nothing (the general path runs)."""
    from mmspec.ragged import RaggedKV
    from mmspec.spec_target import chain_visibility

    def store(mask, committed):
        kv = RaggedKV(1, mask, 64)
        kv.plan_prefill(mask)
        kv.scrub_padding()
        kv.advance(torch.tensor(committed), committed)
        return kv

    ones = torch.ones(3, 4, dtype=torch.long)
    padded = ones.clone()
    padded[1, 0] = 0
    cases = [(ones, [2, 2, 2], True), (padded, [2, 2, 2], False), (ones, [2, 1, 2], False)]
    for mask, committed, fast in cases:
        for T, Q in ((0, 1), (0, 6), (2, 1), (2, 4)):
            B = mask.shape[0]
            vis, _ = chain_visibility(B, T + Q, "cpu")
            region_vis = vis[:, T:]  # the new tokens' rows of the chain over region + new tokens
            depth = (T + torch.arange(Q)).expand(B, Q)
            plans = []
            for chain in (True, False):
                kv = store(mask, committed)
                att = kv.plan(depth, region_vis, T, sees_region=chain)
                plans.append((att, kv))
            (a, ka), (b, kb) = plans
            assert torch.equal(a.dense(), b.dense()), (committed, T, Q)
            assert torch.equal(a.q_pos, b.q_pos) and torch.equal(a.slot_pos, b.slot_pos)
            assert ka.kv_len == kb.kv_len and ka.past_len == kb.past_len
            assert (ka.write_rows is None) == fast
            assert a.full == (fast and Q == 1)
