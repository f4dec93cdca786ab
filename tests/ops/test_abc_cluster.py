"""memattn.ops.abc.cluster: per-sequence k-means (sequence_kmeans, encoders) and the online
centres of causal models (nearest_centre, update_centres), against hand computations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memattn.ops.abc.cluster import nearest_centre, sequence_kmeans, update_centres

F64 = torch.float64


def separated_keys(T=12, H=2, D=3, n=3, seed=0):
    """Keys [1, T, H, D] around n far-apart points, and the point each key came from [T]."""
    g = torch.Generator().manual_seed(seed)
    points = torch.eye(D, dtype=F64)[:n] * 10  # [n, D]
    label = torch.arange(T) % n
    k = points[label][:, None, :] + 0.1 * torch.randn(T, H, D, generator=g, dtype=F64)
    return k[None], label


def same_partition(a: list[int], b: list[int]) -> bool:
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in range(len(a)) for j in range(len(a)))


def test_sequence_kmeans_finds_separated_clusters():
    k, label = separated_keys()
    c = sequence_kmeans(k, 3, iters=2)
    assert c.shape == (1, 12, 2) and c.dtype == torch.int64
    for h in range(2):
        assert same_partition(c[0, :, h].tolist(), label.tolist())


def test_sequence_kmeans_starts_from_evenly_ranked_keys():
    """iters = 0: the initial centres are the real keys of ranks ⌊j L / n⌋, each its own cluster."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 10, 1, 4, generator=g, dtype=F64)
    c = sequence_kmeans(k, 4, iters=0)[0, :, 0]
    assert [int(c[t]) for t in (0, 2, 5, 7)] == [0, 1, 2, 3]  # ranks 0, 10 // 4, 20 // 4, 30 // 4
    dist = torch.cdist(k[0, :, 0], k[0, [0, 2, 5, 7], 0])
    assert torch.equal(c, dist.argmin(-1))


def test_sequence_kmeans_ignores_padding():
    k, _ = separated_keys(T=9)
    mask = torch.ones(1, 14, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[0, 12:] = False  # and right padding
    padded = torch.full((1, 14, 2, 3), 1e4, dtype=F64)
    padded[0, 3:12] = k[0]
    alone = sequence_kmeans(k, 3, iters=3)
    assert torch.equal(sequence_kmeans(padded, 3, iters=3, mask=mask)[:, 3:12], alone)


def test_nearest_centre_is_the_largest_cosine():
    g = torch.Generator().manual_seed(2)
    unit = F.normalize(torch.randn(2, 5, 3, 4, generator=g, dtype=F64), dim=-1)
    centres = F.normalize(torch.randn(3, 6, 4, generator=g, dtype=F64), dim=-1)
    c = nearest_centre(unit, centres)
    for b in range(2):
        for t in range(5):
            for h in range(3):
                cos = [float(unit[b, t, h] @ centres[h, j]) for j in range(6)]
                assert int(c[b, t, h]) == max(range(6), key=cos.__getitem__)


def test_update_centres_moves_each_centre_towards_its_mean_unit_key():
    g = torch.Generator().manual_seed(3)
    unit = F.normalize(torch.randn(2, 6, 1, 3, generator=g, dtype=F64), dim=-1)
    centres = F.normalize(torch.randn(1, 3, 3, generator=g, dtype=F64), dim=-1)
    cluster = torch.tensor([[0, 0, 1, 0, 1, 1], [1, 0, 0, 0, 0, 0]])[..., None]  # none in 2
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 3:] = False
    before = centres.clone()
    moved = update_centres(centres, unit, cluster, 0.75, mask)
    for j in range(2):
        keys = [unit[b, t, 0] for b in range(2) for t in range(6)
                if cluster[b, t, 0] == j and mask[b, t]]
        want = F.normalize(0.75 * centres[0, j] + 0.25 * torch.stack(keys).mean(0), dim=0)
        torch.testing.assert_close(moved[0, j], want)
    assert torch.equal(moved[0, 2], centres[0, 2])  # no member: stays
    assert torch.equal(centres, before)  # pure: the input is untouched
