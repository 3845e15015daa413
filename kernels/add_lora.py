"""``add_lora``: the one entry point the model calls after each LoRA-capable base matmul.

It checks the call (shapes, dtypes, devices, strides) with no host synchronisation, then
picks a backend: the Triton SGMV kernels (shrink, then expand) on CUDA tensors (or on the CPU under
``TRITON_INTERPRET=1``), a vectorised torch path on CPU tensors.
"""

from __future__ import annotations

import torch

from .batch import LoRABatch
from .reference import add_lora_torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "triton", "torch")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share bytes, from their sizes and strides alone (no host sync).

    Exact for two row-major 2-D views of one row stride (column ranges of one buffer, say);
    otherwise whether their extents meet, which may refuse views that only interleave."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def extent(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = extent(a), extent(b)
    if not (a_lo < b_hi and b_lo < a_hi):
        return False
    size = a.element_size()
    row, a_width, b_width = a.stride(0) * size, a.shape[-1] * size, b.shape[-1] * size
    if (a.dim() == b.dim() == 2 and a.stride() == b.stride() and a.stride(1) == 1 and b.element_size() == size
            and row >= max(a_width, b_width)):
        # Row j of b starts d + (j - i) * row bytes after row i of a: they meet iff some
        # k = j - i in [1 - rows of a, rows of b - 1] has -b_width < d + k * row < a_width.
        d = b_lo - a_lo
        k_lo = max(1 - a.shape[0], (-b_width - d) // row + 1)
        k_hi = min(b.shape[0] - 1, (a_width - d - 1) // row)
        return k_lo <= k_hi
    return True


def _check(y, x, lora_a, lora_b, scaling, batch, ranks, output_slices) -> tuple[int, ...]:
    """Validates a call; returns the output slices (one slice when none are given)."""
    if not isinstance(batch, LoRABatch):
        raise TypeError(f"batch must be a LoRABatch (LoRABatch.build(token_slots, num_slots)), got {type(batch).__name__}")
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"x and y must be 2-D [tokens, features], got {tuple(x.shape)} and {tuple(y.shape)}")
    num_tokens, in_features = x.shape
    out_features = y.shape[1]
    if y.shape[0] != num_tokens or batch.num_tokens != num_tokens:
        raise ValueError(f"x has {num_tokens} rows, y {y.shape[0]}, the batch {batch.num_tokens}: they must agree")
    slices = tuple(int(o) for o in output_slices) if output_slices is not None else (out_features,)
    if any(o <= 0 for o in slices) or sum(slices) != out_features:
        raise ValueError(f"output_slices {slices} must be positive and sum to y's {out_features} columns")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError("lora_a must be [slots, n*rank, in] and lora_b [slots, out, rank]")
    num_slots, _, rank = lora_b.shape
    expected_a = (num_slots, len(slices) * rank, in_features)
    if tuple(lora_a.shape) != expected_a:
        raise ValueError(f"lora_a is {tuple(lora_a.shape)}, expected {expected_a} for lora_b {tuple(lora_b.shape)} and {len(slices)} slice(s)")
    if lora_b.shape[1] != out_features:
        raise ValueError(f"lora_b has {lora_b.shape[1]} output rows, y has {out_features} columns")
    if batch.num_slots != num_slots:
        raise ValueError(f"the batch was built for {batch.num_slots} slots, the buffers have {num_slots}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    for name, t in (("y", y), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} is {t.dtype} but x is {x.dtype}: all four must share a dtype")
    if scaling.dtype != torch.float32 or tuple(scaling.shape) not in ((num_slots,), (num_slots, len(slices))):
        raise ValueError(f"scaling must be float32 [{num_slots}] or [{num_slots}, {len(slices)}], got {scaling.dtype} {tuple(scaling.shape)}")
    if ranks is not None and (ranks.dtype != torch.int32
                              or tuple(ranks.shape) not in ((num_slots,), (num_slots, len(slices)))):
        raise ValueError(f"ranks must be int32 [{num_slots}] or [{num_slots}, {len(slices)}], "
                         f"got {ranks.dtype} {tuple(ranks.shape)}")
    # Rows may be strided (a view into a wider buffer); within a row, elements must be dense.
    for name, t in (("x", x), ("y", y), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension (stride {t.stride(-1)}); call .contiguous()")
    if num_tokens > 1 and y.stride(0) < out_features:
        raise ValueError(f"rows of y overlap (row stride {y.stride(0)} < {out_features} columns): each row adds "
                         "its own term in place, so each needs its own memory")
    if lora_a.stride(1) < in_features or lora_b.stride(1) < rank:
        raise ValueError("lora_a and lora_b rows must not overlap")
    for name, t in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b), ("scaling", scaling), ("ranks", ranks)):
        if t is not None and _overlaps(y, t):
            raise ValueError(f"y shares memory with {name}: the term is added into y in place, while {name} is "
                             "read, so y must not overlap its inputs")
    devices = {t.device for t in (y, x, lora_a, lora_b, scaling, batch.token_slots)}
    if ranks is not None:
        devices.add(ranks.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return slices


def add_lora(
    y: torch.Tensor,  # [T, out]: updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n*R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    scaling: torch.Tensor,  # float32 [S] or [S, n]
    batch: LoRABatch,
    ranks: torch.Tensor | None = None,  # int32 [S] or [S, n]
    backend: str = "auto",
    output_slices: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Adds each row's own adapter term into ``y`` and returns ``y``.

    Semantics, for each row t with slot s = batch.token_slots[t] >= 0 and slice i::

        y[t, off_i : off_i + o_i] += scaling[s, i] * (x[t] @ A_i[s].T) @ B_i[s].T

    with A_i = lora_a[:, i*R:(i+1)*R] and B_i = lora_b[:, off_i:off_i+o_i] (one slice, the
    whole of y, when ``output_slices`` is None). ``ranks`` is one rank per slot ([S]) or one
    per slot and slice ([S, n]): rank rows and columns of slice i of slot s at or past its rank
    are never read and do not change the result; a slice of rank 0 adds nothing and costs
    its rows nothing (an adapter on q and v alone skips k of a fused q/k/v call). ``ranks`` may
    be a strided view, e.g. columns of a per-projection table. No host synchronisation on
    the Triton path, which takes at most 3 slices (q/k/v) a call; the torch path takes any.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    slices = _check(y, x, lora_a, lora_b, scaling, batch, ranks, output_slices)
    if x.numel() == 0:  # no rows, or no input columns: the term is zero
        return y
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        add_lora_torch(y, x, lora_a, lora_b, scaling, batch.token_slots, ranks, slices)
        return y
    _check_triton(x, batch, slices)
    sgmv_lora(y, x, lora_a, lora_b, scaling, batch, ranks, slices)
    return y


def check_interpreter(x: torch.Tensor) -> None:
    """Refuses CPU tensors unless Triton interprets its kernels (TRITON_INTERPRET, any value
    Triton reads as true, set before the kernels are first imported): compiled kernels would
    fail on them with no word of the fix."""
    if x.is_cuda:
        return
    from triton.runtime.interpreter import InterpretedFunction

    from .shrink import _shrink_kernel

    # Triton decides at a kernel's definition; the kernel itself says which it became.
    if not isinstance(_shrink_kernel, InterpretedFunction):
        raise RuntimeError("the Triton kernels on CPU tensors need Triton's interpreter: TRITON_INTERPRET=1 set "
                           "before loraplex.kernels is imported")


def _check_triton(x: torch.Tensor, batch: LoRABatch, slices: tuple[int, ...]) -> None:
    """What the Triton kernels need beyond ``_check``: checked before anything is launched,
    so a refused call writes nothing."""
    from .expand import MAX_SLICES  # imports triton only when the Triton path is used

    check_interpreter(x)
    if batch.block_m < 16 or batch.block_m & (batch.block_m - 1):
        raise ValueError(f"the Triton path needs block_m a power of two >= 16, the batch has {batch.block_m}")
    if len(slices) > MAX_SLICES:
        raise ValueError(f"the Triton path adds at most {MAX_SLICES} output slices in one launch, got {len(slices)}")


def sgmv_lora(y, x, lora_a, lora_b, scaling, batch, ranks, slices, config=None) -> None:
    """The Triton path: shrink over split K into float32 partials, then expand into y."""
    from .configs import sgmv_config  # imports triton only when the Triton path is used
    from .expand import sgmv_expand
    from .shrink import sgmv_shrink

    rank = lora_b.shape[2]
    if config is None:
        config = sgmv_config(batch.num_blocks, batch.block_m, x.shape[1], slices, rank, x.dtype, x.device)
    partial = sgmv_shrink(x, lora_a, batch, ranks, rank, config.k_splits, config.block_k, config.num_warps,
                          config.num_stages, wait_before=config.pdl and config.pdl_early,
                          trigger=(1 if config.pdl_early else 2) if config.pdl else 0)
    sgmv_expand(y, partial, lora_b, scaling, batch, ranks, slices, config.span, config.block_n, config.num_warps,
                config.num_stages, config.pdl, config.add_in_memory)
