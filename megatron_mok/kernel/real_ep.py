"""Future real-EP entry (one rank per GPU). Not implemented yet; kept separate from the emulated path.

Plan (same device code as the emulated launch, csrc/mok/*):
  * Buffers that other ranks read or write live in torch symmetric memory
    (``torch.distributed._symmetric_memory.empty`` + ``rendezvous(t, group)``): x (pull dispatch reads
    it), combine_buf (push combine writes it), topk_idx (the schedule reads every rank's routing), and a
    signal pad for the start/finish barriers.
  * The per-rank table (``RankTable`` in csrc/mok/common.cuh) is filled with peer pointers
    (``handle.buffer_ptrs[r]``) instead of the emulated per-rank tensors; R = world size, and each GPU
    launches the kernel with ONE partition (ctas_per_rank = num_sms) for its own rank q.
  * The three grid barriers of the schedule and the final "all ranks computed" wait become signal-pad
    barriers at .sys scope (epoch counters, no zeroing); ring counters stay GPU-local.
  * Weights stay local: rank q only needs w1/w2 of its own L experts.
"""

from __future__ import annotations


def mok_forward_symmetric(*args, **kwargs):  # pragma: no cover - placeholder
    raise NotImplementedError(
        "real multi-GPU EP for the MoK kernel is not implemented yet; use mok_forward_emulated "
        "(all ranks on one GPU) or the torch reference backend"
    )
