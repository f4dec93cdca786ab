"""abc-cluster: ABC with clustering control; slot j holds the mean of the keys / values in cluster j.

Two algorithms find the clusters (the ops in `memattn.ops.abc.cluster`):

    encoders        per-sequence k-means (`sequence_kmeans`): Lloyd iterations over the keys
                    of the sequence; the memory is read with `bounded_memory_attention`.
    causal models   online centres (`nearest_centre`, `update_centres`): a future key must
                    not move a centre, so n unit centres per head are kept across sequences
                    and moved by every training forward; the memory is ABC_MLP's, so
                    decoding keeps its fixed-size state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError
from memattn.layers.abc.common import PAD_LOGIT, ABCLayer, ABCMemoryState, check_positive
from memattn.layers.base import Cross, LayerSpec, StateSize, register
from memattn.layers.cross import SlotCrossAttention
from memattn.ops.abc import BoundedMemoryState, bounded_memory_attention
from memattn.ops.abc.cluster import nearest_centre, sequence_kmeans, update_centres
from memattn.ops.contract import compute_dtype


@dataclass
class ABCClusterOptions:
    """Options of `abc-cluster`.

    num_clusters: n, memory slots per head: the clusters the keys are grouped into.
    iters: Lloyd iterations (assign every key to its nearest centre, move each centre to
        the mean of its keys) after the initial centres; bidirectional only.
    decay: causal only: the centres are running means of the unit keys assigned to them,
        c <- normalise(decay · c + (1 - decay) · mean), updated by every training forward.
    bias: biases on the q/k/v and output projections.
    """

    num_clusters: int = 32
    iters: int = 3
    decay: float = 0.99
    bias: bool = False

    def __post_init__(self) -> None:
        check_positive("num_clusters", self.num_clusters)
        check_positive("iters", self.iters)
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"attention.decay: expected a number in [0, 1), got {self.decay!r}")


class ClusterCrossAttention(SlotCrossAttention):
    """abc-cluster cross attention: the source keys grouped by k-means (`sequence_kmeans`);
    slot j holds the mean key / value of cluster j (an empty cluster holds zeros)."""

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> BoundedMemoryState:
        k, v = self.source_kv(src, src_mask)
        n = self.options.num_clusters
        member = F.one_hot(sequence_kmeans(k, n, self.options.iters, src_mask), n).to(compute_dtype(k))
        if src_mask is not None:
            member = member * src_mask[:, :, None, None]
        return self.given_phi(k, v, member / member.sum(1, keepdim=True).clamp(min=1))


@register("abc-cluster", options=ABCClusterOptions, state_size=StateSize("num_clusters"),
          cross=Cross(ClusterCrossAttention, "one slot per cluster of the source keys (k-means "
                      "over the source): slot j the mean key and value of cluster j "
                      "(BoundedMemoryState)"),
          test_options={"num_clusters": 8})
class ABCClusterAttention(ABCLayer):
    """ABC with clustering control: slot j holds the mean of the keys / values in cluster j.

    Bidirectional (`read_sequence_kmeans`): the keys of each head are grouped into n
    clusters by k-means over the sequence (`sequence_kmeans`, on the keys after rotary
    positions, without gradient: the assignment is discrete); φ_i = e_{c(i)} / |cluster c(i)|,
    read by every query with a softmax over the slots (`bounded_memory_attention`). A cluster
    left empty is a slot nothing was written to (K̃ = 0, score 0), as in the op.

    Causal (`read_online_centres`): a future key cannot move a centre, so the centres are
    kept across sequences (online spherical k-means, as in the Routing Transformer): n unit
    vectors per head, a buffer moved towards the unit keys assigned to it by every training
    forward (see `decay`). Token i goes to the centre of largest cosine, c(i), and slot j at
    position t holds the mean of the keys / values of positions ≤ t in cluster j: ABC_MLP
    with slot logits 0 for c(i) and PAD_LOGIT / 2 elsewhere, so decoding keeps the same
    fixed-size state. A slot with no member yet holds the mean of the real tokens of the
    prefix; padding (PAD_LOGIT, far below a non-member) writes nothing, even there.
    """

    def __init__(self, spec: LayerSpec, options: ABCClusterOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        self.num_slots = options.num_clusters
        centres = torch.randn(spec.n_heads, options.num_clusters, spec.head_dim)
        self.register_buffer("centres", F.normalize(centres, dim=-1))  # [H, n, D], causal only

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """Causal only: the ABC_MLP memory of n slots (log_z [B, H, n], [B, H, n, D] twice)."""
        if not self.spec.causal:
            raise ConfigError("attention: 'abc-cluster' in a bidirectional model clusters "
                              "the whole sequence and has no decoding state")
        return self.empty_abc_state(batch_size, self.num_slots, device, dtype)

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state)."""
        _, q, k, v = self.project(x, memory_state, attention_mask, positions)
        if self.spec.causal:
            return self.read_online_centres(q, k, v, memory_state, attention_mask), memory_state
        return self.read_sequence_kmeans(q, k, v, attention_mask), None

    # ----------------------------------------------------------- causal: online centres

    @torch.no_grad()
    def move_centres(self, unit: torch.Tensor, cluster: torch.Tensor,
                     mask: torch.Tensor | None) -> None:
        """One online k-means step: each centre towards the mean unit key assigned to it."""
        self.centres.copy_(update_centres(self.centres, unit, cluster, self.options.decay, mask))

    def read_online_centres(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            memory_state: ABCMemoryState | None,
                            attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Causal models: q, k, v [B, T, H, D] -> y [B, T, d]. Each key joins the kept centre
        of largest cosine (a training forward then moves the centres) and slot j holds the
        prefix mean of its members, through the ABC_MLP memory (continuing memory_state)."""
        unit = F.normalize(k.detach().to(compute_dtype(k)), dim=-1)  # fp32 at least
        cluster = nearest_centre(unit, self.centres)  # [B, T, H]
        if self.training:
            self.move_centres(unit, cluster, attention_mask)
        s = torch.where(F.one_hot(cluster, self.num_slots).bool(), 0.0, PAD_LOGIT / 2).to(q.dtype)
        return self.attend_logits(q, k, v, s, memory_state, attention_mask)

    # ------------------------------------------------------ encoders: per-sequence k-means

    def read_sequence_kmeans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Encoders: q, k, v [B, T, H, D] -> y [B, T, d]. The keys of the sequence are grouped
        by k-means and slot j holds the mean of cluster j (padding writes nothing)."""
        n = self.num_slots
        member = F.one_hot(sequence_kmeans(k, n, self.options.iters, attention_mask), n).to(q.dtype)
        if attention_mask is not None:
            member = member * attention_mask[:, :, None, None].to(q.dtype)
        phi = member / member.sum(1, keepdim=True).clamp(min=1)  # [B, T, H, n]
        o, _ = bounded_memory_attention(q, k, v, phi, causal=False)
        return self.finish(o)
