"""Clustering control for ABC: which slot each key writes to (abc-cluster).

Slot j holds the mean of the keys / values in cluster j. How the clusters are found depends
on whether a query may see the whole sequence:

    per-sequence k-means (encoders)
        `sequence_kmeans`: the keys of each sequence and head are grouped by Lloyd's
        k-means over that sequence alone; nothing is kept between sequences.

    online centres (causal models)
        A future key must not move a centre, so the centres are kept across sequences
        (online spherical k-means, as in the Routing Transformer): n unit vectors per head.
        `nearest_centre` assigns each unit key to the centre of largest cosine;
        `update_centres` moves each centre towards the mean unit key assigned to it (what a
        training forward does), never during evaluation or decoding.

All three are discrete and take no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequence_kmeans(k: torch.Tensor, n: int, iters: int,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence k-means (encoders): k [B, T, H, D] -> the cluster of each key,
    [B, T, H] in 0 .. n-1, for each sequence and head on its own.

    Deterministic: the initial centres are the keys of the real tokens of ranks
    ⌊j L / n⌋, j = 0 .. n-1 (L real tokens, in order); then `iters` Lloyd iterations, and a
    last assignment to the nearest centre (ties to the lowest index). A centre that loses
    all its keys stays where it is. Padding (mask [B, T] False) is assigned but moves no
    centre. Distances are taken elementwise (never through a matrix product), so a key's
    cluster does not depend on padding.
    """
    B, T, H, D = k.shape
    kt = k.detach().transpose(1, 2)  # [B, H, T, D]
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=k.device)
    L = real.sum(1)  # [B]
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices  # real tokens first
    ranks = torch.arange(n, device=k.device)[None] * L[:, None] // n  # [B, n]
    ranks = torch.minimum(ranks, (L - 1).clamp(min=0)[:, None])
    start = order.gather(1, ranks)  # [B, n] positions of the initial centres
    centres = kt.gather(2, start[:, None, :, None].expand(B, H, n, D))  # [B, H, n, D]
    weight = real[:, None, :, None].to(kt.dtype)  # [B, 1, T, 1]

    def nearest(c: torch.Tensor) -> torch.Tensor:  # [B, H, T]; no [B, H, T, n, D] difference
        return torch.cdist(kt, c, compute_mode="donot_use_mm_for_euclid_dist").argmin(-1)

    for _ in range(iters):
        member = F.one_hot(nearest(centres), n).to(kt.dtype) * weight  # [B, H, T, n]
        count = member.sum(2)[..., None]  # [B, H, n, 1]
        sums = member.transpose(2, 3) @ kt  # [B, H, n, D]
        centres = torch.where(count > 0, sums / count.clamp(min=1), centres)
    return nearest(centres).transpose(1, 2)  # [B, T, H]


def nearest_centre(unit: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Online centres (causal models): unit keys [B, T, H, D], unit centres [H, n, D] ->
    the centre of largest cosine, [B, T, H]."""
    return torch.einsum("bthd,hnd->bthn", unit, centres.to(unit.dtype)).argmax(-1)


@torch.no_grad()
def update_centres(centres: torch.Tensor, unit: torch.Tensor, cluster: torch.Tensor,
                   decay: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Online centres (causal models): one online spherical k-means step.

    centres [H, n, D] unit vectors; unit keys [B, T, H, D] and their clusters [B, T, H]
    (from `nearest_centre`); mask [B, T] bool (False: padding, moves nothing). Returns the
    centres, in their dtype, each moved to normalise(decay · c + (1 - decay) · mean of the
    unit keys assigned to it); a centre with no key stays where it is.
    """
    n = centres.shape[1]
    member = F.one_hot(cluster, n).to(unit.dtype)  # [B, T, H, n]
    if mask is not None:
        member = member * mask[:, :, None, None]
    sums = torch.einsum("bthn,bthd->hnd", member, unit).to(centres.dtype)
    count = member.sum((0, 1))[..., None].to(centres.dtype)  # [H, n, 1]
    moved = F.normalize(decay * centres + (1 - decay) * sums / count.clamp(min=1), dim=-1)
    return torch.where(count > 0, moved, centres)
