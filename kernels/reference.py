"""The LoRA term in plain torch: the reference the kernels are tested against, and the path
``add_lora`` takes on CPU tensors.

For every row t whose slot s = token_slots[t] is not -1, and every output slice i::

    y[t, off_i : off_i + o_i] += scaling[s, i] * (x[t] @ A_i[s, :r_s].T) @ B_i[s, :, :r_s].T

where A_i = lora_a[:, i*R:(i+1)*R, :], B_i = lora_b[:, off_i:off_i+o_i, :] and r_s = ranks[s]
(ranks [S]), ranks[s, i] (ranks [S, n]: one per slice), or R when no ranks are given.
"""

from __future__ import annotations

import torch

# Rows gathered at once by the torch path: bounds its [rows, n*R, in] weight gather.
_TORCH_CHUNK_ROWS = 256


def _slice_bounds(out_features: int, output_slices: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """[(first column, width)] of each output slice."""
    slices = output_slices or (out_features,)
    bounds, offset = [], 0
    for width in slices:
        bounds.append((offset, width))
        offset += width
    return bounds


def _per_slice_scaling(scaling: torch.Tensor, num_slices: int) -> torch.Tensor:
    """float32 [S] or [S, n] -> [S, n]."""
    return scaling[:, None].expand(-1, num_slices) if scaling.dim() == 1 else scaling


def _rank_mask(lora_a: torch.Tensor, ranks: torch.Tensor | None, rank: int, num_slices: int) -> torch.Tensor | None:
    """bool [S, n, R]: True where a rank row of a slice is inside its rank; None when all are."""
    if ranks is None:
        return None
    per_slice = ranks[:, None].expand(-1, num_slices) if ranks.dim() == 1 else ranks
    return torch.arange(rank, device=lora_a.device) < per_slice[:, :, None].to(lora_a.device)


def add_lora_reference(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    token_slots: torch.Tensor,  # int [T], -1 = no adapter
    ranks: torch.Tensor | None = None,  # int [S] or [S, n]
    output_slices: tuple[int, ...] | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Returns y + the LoRA term, in ``compute_dtype`` (y itself is not changed)."""
    bounds = _slice_bounds(y.shape[1], output_slices)
    rank = lora_b.shape[2]
    scale = _per_slice_scaling(scaling, len(bounds)).to(compute_dtype)
    mask = _rank_mask(lora_a, ranks, rank, len(bounds))

    out = y.to(compute_dtype).clone()
    rows = torch.nonzero(token_slots >= 0).flatten()
    slots = token_slots[rows].long()
    xs = x[rows].to(compute_dtype)  # [t, in]
    for i, (offset, width) in enumerate(bounds):
        a = lora_a[slots, i * rank : (i + 1) * rank, :].to(compute_dtype)  # [t, R, in]
        b = lora_b[slots, offset : offset + width, :].to(compute_dtype)  # [t, o, R]
        s = scale[slots, i]  # [t]
        if mask is not None:  # past the rank is no part of the adapter, whatever it holds
            keep = mask[slots, i]  # [t, R]
            a = torch.where(keep[:, :, None], a, 0)
            b = torch.where(keep[:, None, :], b, 0)
            s = torch.where(keep.any(1), s, 0)  # a slice of rank 0 adds nothing
        v = torch.einsum("tk,trk->tr", xs, a)  # shrink: [t, R]
        delta = torch.einsum("tr,tor->to", v, b) * s[:, None]  # expand: [t, o]
        out[rows, offset : offset + width] += delta
    return out


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor | None = None,
    output_slices: tuple[int, ...] | None = None,
) -> None:
    """The LoRA term added into ``y`` in place, vectorised over rows (a gather per chunk of rows).

    Base-only rows gather slot 0 and are masked out, so nothing depends on a host read of
    the slots; the matmuls run in the inputs' dtype with float32 scaling, like PEFT.
    """
    bounds = _slice_bounds(y.shape[1], output_slices)
    rank = lora_b.shape[2]
    scale = _per_slice_scaling(scaling, len(bounds)).to(torch.float32)
    mask = _rank_mask(lora_a, ranks, rank, len(bounds))

    for start in range(0, x.shape[0], _TORCH_CHUNK_ROWS):
        stop = min(start + _TORCH_CHUNK_ROWS, x.shape[0])
        slots = token_slots[start:stop].long()
        active = slots >= 0  # [t]
        slots = slots.clamp(min=0)
        # Rank entries a row may use: inside its slice's rank, and only for adapter rows.
        # Selected with `where`, not multiplied, so whatever lies in the padding never leaks.
        keep = active[:, None, None] if mask is None else mask[slots] & active[:, None, None]  # [t, n or 1, R]
        xs = x[start:stop]
        a = lora_a[slots]  # [t, n*R, in]
        v = torch.bmm(a, xs.unsqueeze(2)).squeeze(2).float()  # shrink, all slices: [t, n*R]
        for i, (offset, width) in enumerate(bounds):
            keep_i = keep[:, min(i, keep.shape[1] - 1)]  # [t, R]
            # Scaled before the `where`: base rows gather slot 0's scale, which may be anything.
            vi = torch.where(keep_i, v[:, i * rank : (i + 1) * rank] * scale[slots, i][:, None], 0.0)
            b = torch.where(keep_i[:, None, :], lora_b[slots, offset : offset + width, :], 0)  # [t, o, R]
            delta = torch.bmm(b, vi.to(b.dtype).unsqueeze(2)).squeeze(2)  # expand: [t, o]
            y[start:stop, offset : offset + width] += delta.to(y.dtype)
