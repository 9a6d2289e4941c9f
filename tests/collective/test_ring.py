"""Ring all-reduce over real frames: equal to the dense reference, same bits everywhere."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedring.collective import chunk_bounds, majority_vote, run_local_ring
from fedring.collective.local import LocalRun
from fedring.collective.torus import grid_dims, grid_rows, layout_name
from fedring.compression import GroupTopK
from fedring.compression.sparse import SparseGroups
from tests.strategies import flat_vectors, value_dtypes

worlds = st.integers(1, 8)
Layout = tuple[int, tuple[int, ...]]
# (world, grid axes): () is the flat ring, (R, C) an R x C torus, (A, B, C) a 3-D one
layouts = st.one_of(
    worlds.map(lambda w: (w, ())),
    st.sampled_from([(4, (2, 2)), (6, (2, 3)), (6, (3, 2)), (8, (2, 4)), (9, (3, 3)),
                     (12, (3, 4)), (2, (1, 2)), (3, (3, 1)), (8, (2, 2, 2)), (12, (2, 2, 3)),
                     (12, (3, 2, 2)), (18, (2, 3, 3)), (6, (1, 2, 3))]),
)  # fmt: skip
group_sizes = st.sampled_from([1, 3, 64, 256, 300])


def _inputs(data: st.DataObject, world: int, dyadic: bool = False) -> list[torch.Tensor]:
    first = data.draw(flat_vectors(max_numel=2500, dyadic=dyadic))
    rest = [
        data.draw(flat_vectors(max_numel=first.numel(), dyadic=dyadic)) for _ in range(world - 1)
    ]
    return [first] + [
        torch.cat([r, r.new_zeros(first.numel() - r.numel())])[: first.numel()] for r in rest
    ]


def _same_everywhere(results: list[torch.Tensor]) -> bool:
    return all(torch.equal(r, results[0]) for r in results)


@given(layout=layouts, data=st.data())
def test_dense_ring_equals_the_sum(layout: Layout, data: st.DataObject) -> None:
    world, dims = layout
    xs = _inputs(data, world)
    ref = torch.stack([x.double() for x in xs]).sum(0)
    run = run_local_ring(
        world, lambda ring: ring.allreduce_dense(xs[ring.rank]), key=b"k", grid_dims=dims
    )
    assert _same_everywhere(run.results)
    torch.testing.assert_close(
        run.results[0].double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()) + 1e-30
    )


@given(layout=layouts, g=group_sizes, data=st.data())
def test_exact_sparse_ring_equals_the_sum_of_sparse_inputs(
    layout: Layout, g: int, data: st.DataObject
) -> None:
    world, dims = layout
    xs = _inputs(data, world)
    topk = GroupTopK(g, data.draw(st.integers(1, min(g, 5))))
    sparse = [topk.compress(x) for x in xs]
    ref = torch.stack([s.decompress().double() for s in sparse]).sum(0)
    run = run_local_ring(
        world,
        lambda ring: ring.allreduce_sparse(sparse[ring.rank], policy="exact"),
        grid_dims=dims,
    )
    outs = [r[0] for r in run.results]
    assert _same_everywhere(outs)
    assert all(not bool(r[1].any()) for r in run.results)  # exact keeps nothing back
    torch.testing.assert_close(
        outs[0].double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()) + 1e-30
    )


@given(layout=layouts, g=group_sizes, dtype=st.sampled_from(["fp32", "fp16"]), data=st.data())
def test_bounded_ring_conserves_every_dropped_entry_exactly(
    layout: Layout, g: int, dtype: str, data: st.DataObject
) -> None:
    world, dims = layout
    xs = _inputs(
        data, world, dyadic=True
    )  # sums exact in fp32: the invariant must hold bit for bit
    topk = GroupTopK(g, data.draw(st.integers(1, min(g, 4))), dtype)  # type: ignore[arg-type]
    sparse = [topk.compress(x) for x in xs]
    run = run_local_ring(
        world,
        lambda ring: ring.allreduce_sparse(sparse[ring.rank], policy="bounded"),
        grid_dims=dims,
    )
    outs, kept = [r[0] for r in run.results], [r[1] for r in run.results]
    assert _same_everywhere(outs)
    inputs_total = torch.stack([s.decompress() for s in sparse]).sum(0)
    assert torch.equal(outs[0] + torch.stack(kept).sum(0), inputs_total)
    groups = -(-xs[0].numel() // g)
    assert int((outs[0] != 0).sum()) <= groups * topk.k  # still k per group


@given(layout=layouts, g=group_sizes, dtype=value_dtypes, data=st.data())
def test_bounded_conservation_with_arbitrary_floats(
    layout: Layout, g: int, dtype: str, data: st.DataObject
) -> None:
    world, dims = layout
    xs = _inputs(data, world)
    sparse = [GroupTopK(g, 1, dtype).compress(x) for x in xs]  # type: ignore[arg-type]
    run = run_local_ring(
        world,
        lambda ring: ring.allreduce_sparse(sparse[ring.rank], policy="bounded"),
        grid_dims=dims,
    )
    total = run.results[0][0].double() + sum(r[1].double() for r in run.results)
    ref = torch.stack([s.decompress().double() for s in sparse]).sum(0)
    # fp32 partial sums round at the inputs' magnitude, which cancellation can hide in
    # `ref` (found: 1.54 - 2.17 + 0.66 = 0.037, off by one fp32 step of 2.17)
    size = float(torch.stack([s.decompress().double().abs() for s in sparse]).sum(0).max())
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=1e-6 * size + 1e-30)


@given(world=worlds, data=st.data())
def test_sparse_allgather_baseline_equals_the_sum(world: int, data: st.DataObject) -> None:
    xs = _inputs(data, world)
    sparse = [GroupTopK(64, 2).compress(x) for x in xs]
    ref = torch.stack([s.decompress().double() for s in sparse]).sum(0)
    run = run_local_ring(world, lambda ring: ring.allgather_sparse(sparse[ring.rank]))
    assert _same_everywhere(run.results)
    torch.testing.assert_close(
        run.results[0].double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()) + 1e-30
    )


@given(world=worlds, data=st.data())
def test_majority_vote_is_the_sign_of_the_sum_of_signs(world: int, data: st.DataObject) -> None:
    xs = _inputs(data, world)
    ref = torch.sign(torch.stack([torch.sign(x) for x in xs]).sum(0)).to(torch.int8)
    run = run_local_ring(world, lambda ring: majority_vote(ring, xs[ring.rank]))
    assert all(torch.equal(v, ref) for v in run.results)


def test_large_groups_and_k_one() -> None:
    xs = [torch.randn(200_003, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    sparse = [GroupTopK(65536, 1).compress(x) for x in xs]
    ref = torch.stack([s.decompress() for s in sparse]).sum(0)
    run = run_local_ring(3, lambda ring: ring.allreduce_sparse(sparse[ring.rank], policy="exact"))
    torch.testing.assert_close(run.results[0][0], ref, rtol=1e-6, atol=1e-6)


def test_payloads_larger_than_a_frame_are_split_and_rejoined() -> None:
    xs = [torch.randn(300_000) for _ in range(2)]
    run = run_local_ring(2, lambda ring: ring.allreduce_dense(xs[ring.rank]))
    torch.testing.assert_close(run.results[0], xs[0] + xs[1])
    assert run.stats[0].frames_sent > 2  # 600 KB chunks in 256 KiB frames


def test_bounded_sends_2_n_minus_1_over_n_of_one_payload_whatever_n() -> None:
    numel, topk = 64 * 256 * 16, GroupTopK(256, 3, "fp16")
    wire_per_agent = {}
    for world in (2, 4, 8, 16):
        xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(world)]
        sparse = [topk.compress(x) for x in xs]
        run = run_local_ring(world, lambda ring, s=sparse: ring.allreduce_sparse(s[ring.rank]))
        one = sparse[0].wire_nbytes  # 9 bytes a group: 3 uint8 indices, 3 fp16 values
        assert all(b == 2 * (world - 1) * one // world for b in run.payload_bytes)
        wire_per_agent[world] = sum(s.bytes_sent for s in run.stats) / world
    # on the wire, only the per-frame headers grow with N: 2(N-1) frames of < 300 B
    for world, wire in wire_per_agent.items():
        payload = 2 * (world - 1) * sparse[0].wire_nbytes / world
        assert payload < wire < payload + 2 * (world - 1) * 300


def test_chunk_bounds_cover_everything_in_order() -> None:
    for units in (0, 1, 5, 17, 1000):
        for world in (1, 2, 3, 8, 16):
            bounds = chunk_bounds(units, world)
            assert bounds[0][0] == 0 and bounds[-1][1] == units
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_torus_sends_what_the_flat_ring_sends_in_fewer_frames() -> None:
    numel, topk = 64 * 256 * 12, GroupTopK(256, 3, "fp16")
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    sparse = [topk.compress(x) for x in xs]
    flat = run_local_ring(12, lambda ring: ring.allreduce_sparse(sparse[ring.rank]))
    grid = run_local_ring(12, lambda ring: ring.allreduce_sparse(sparse[ring.rank]), grid_rows=3)
    assert grid.payload_bytes == flat.payload_bytes  # 2(N-1)/N of one payload either way
    assert all(s.frames_sent == 2 * (4 - 1) + 2 * (3 - 1) for s in grid.stats)
    assert all(s.frames_sent == 2 * (12 - 1) for s in flat.stats)
    assert sum(s.bytes_sent for s in grid.stats) < sum(s.bytes_sent for s in flat.stats)


def test_grid_rows_is_the_largest_divisor_up_to_the_square_root() -> None:
    assert [grid_rows(n) for n in (1, 2, 7, 8, 12, 16, 32, 36)] == [1, 1, 1, 2, 3, 4, 4, 6]


def test_grid_dims_takes_the_fewest_ring_steps() -> None:
    assert [grid_dims(n) for n in (7, 8, 9, 12, 32, 36)] == [
        (7,), (2, 2, 2), (3, 3), (2, 2, 3), (2, 4, 4), (3, 3, 4)
    ]  # fmt: skip
    assert [layout_name("auto", n) for n in (8, 10, 9, 32)] == [
        "ring of 8", "ring of 10", "torus 3x3", "torus 2x4x4"
    ]  # fmt: skip


def test_a_3d_torus_sends_the_same_payload_in_fewer_frames_than_2d() -> None:
    numel, topk = 64 * 256 * 12, GroupTopK(256, 3, "fp16")
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    sparse = [topk.compress(x) for x in xs]
    two = run_local_ring(12, lambda r: r.allreduce_sparse(sparse[r.rank]), grid_dims=(3, 4))
    three = run_local_ring(12, lambda r: r.allreduce_sparse(sparse[r.rank]), grid_dims=(2, 2, 3))
    assert all(s.frames_sent == 2 * (3 - 1) + 2 * (2 - 1) + 2 * (2 - 1) for s in three.stats)
    assert all(s.frames_sent == 2 * (4 - 1) + 2 * (3 - 1) for s in two.stats)
    assert three.payload_bytes == two.payload_bytes
    # (Conservation on 3-D grids is checked with the other layouts above.)
    assert _same_everywhere([out for out, _ in three.results])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and 0.0 told apart


@settings(max_examples=60, deadline=None)
@given(layout=layouts, g=group_sizes, dtype=st.sampled_from(["fp32", "fp16", "bf16"]),
       data=st.data())  # fmt: skip
def test_bounded_sends_untouched_own_rows_as_re_selection_would(
    layout: Layout, g: int, dtype: str, data: st.DataObject
) -> None:
    # The shortcut (a span holding only the member's own payload goes out as its rows)
    # against re-selecting every span, which a payload without the compressor's caches
    # takes: the same sums and kept, bit for bit, signed zeros included.
    world, dims = layout
    xs = _inputs(data, world)
    xs = [torch.where(x.abs() < 0.5, torch.zeros(()), x) * -1.0 for x in xs]  # zeros, -0.0
    topk = GroupTopK(g, data.draw(st.integers(1, min(g, 4))), dtype)  # type: ignore[arg-type]
    made = [topk.compress(x) for x in xs]
    plain = [replace(p, decoded=None, wide_indices=None, host=None) for p in made]

    def reduce(payloads: list[SparseGroups]) -> LocalRun[tuple[torch.Tensor, torch.Tensor]]:
        return run_local_ring(
            world, lambda ring: ring.allreduce_sparse(payloads[ring.rank]), grid_dims=dims
        )

    runs = [reduce(made), reduce(plain)]
    for fast, ref in zip(runs[0].results, runs[1].results, strict=True):
        assert torch.equal(_bits(fast[0]), _bits(ref[0]))
        assert torch.equal(_bits(fast[1]), _bits(ref[1]))


def test_bounded_re_selects_spans_a_partial_payload_does_not_cover() -> None:
    # a payload of groups [2, n) only: its rows cannot stand in for the spans before 2
    gen = torch.Generator().manual_seed(5)
    topk = GroupTopK(16, 2, "fp16")
    made = [topk.compress(torch.randn(200, generator=gen), groups=(2, 13)) for _ in range(3)]
    plain = [replace(p, decoded=None, wide_indices=None, host=None) for p in made]
    runs = [run_local_ring(3, lambda ring, ps=ps: ring.allreduce_sparse(ps[ring.rank]))
            for ps in (made, plain)]  # fmt: skip
    for fast, ref in zip(runs[0].results, runs[1].results, strict=True):
        assert torch.equal(_bits(fast[0]), _bits(ref[0]))
        assert torch.equal(_bits(fast[1]), _bits(ref[1]))
