"""The paths bench/peer_kernels.py times, ours and each peer's, on one case: each builder
converts the case's weights into the layout its path wants (outside the timed region) and
returns fn(y) adding the LoRA term into y (the LoRA-only table), or fn(out) writing the
whole layer x W^T + term (`--layer`), and a note of what it launched.
"""

from __future__ import annotations

import dataclasses
import re
import typing

import torch

from checkout import use_checkout  # noqa: E402  (bench/ is sys.path[0])

use_checkout()

from loraplex.kernels import LoRABatch, add_lora  # noqa: E402
from loraplex.kernels.linear import gemm_config, lora_linear  # noqa: E402
from peer_loading import ROOT, LoRABatchInfo, SGLangPhase  # noqa: E402

CSGMV_DEFAULT_CHUNK = 16  # SGLang's default --max-lora-chunk-size
CSGMV_MAX_CHUNK = 128  # the largest it accepts


# --------------------------------------------------------------------------------------
# Paths: each converts the case's weights into the layout it wants (outside the timed
# region) and returns fn(y), which adds the LoRA term into y, and a note of what it runs.
# --------------------------------------------------------------------------------------

def folded_b(c) -> torch.Tensor:
    """B [S, out, r] with each slice's scaling multiplied in, rounded to the case's dtype."""
    b = c["lora_b"].float().clone()
    offset = 0
    for i, width in enumerate(c["slices"]):
        b[:, offset : offset + width] *= c["scaling"][:, i, None, None].float()
        offset += width
    return b.to(c["lora_b"].dtype).contiguous()


def slice_offsets(slices) -> list[int]:
    offsets = [0]
    for width in slices:
        offsets.append(offsets[-1] + width)
    return offsets


def ours_path(c, P=None, backend="auto"):
    S, slots = c["num_slots"], c["token_slots"]
    distinct = int(torch.unique(slots[slots >= 0]).numel())
    batch = LoRABatch.build(slots, S, max_adapters=max(distinct, 1))
    x, a, b, sc, slices = c["x"], c["lora_a"], c["lora_b"], c["scaling"], c["slices"]
    return (lambda y: add_lora(y, x, a, b, sc, batch, backend=backend, output_slices=slices)), {
        "block_m": batch.block_m, "blocks": batch.num_blocks}


def vllm_path(c, P):
    x, slots, S, r, slices = c["x"], c["token_slots"], c["num_slots"], c["rank"], c["slices"]
    T, n = x.shape[0], len(slices)
    # vLLM caches its stacked-pointer tables by data_ptr: a freed case's addresses may come back.
    P.vllm_utils._LORA_A_PTR_DICT.clear()
    P.vllm_utils._LORA_B_PTR_DICT.clear()
    a = tuple(c["lora_a"][:, i * r : (i + 1) * r].contiguous() for i in range(n))
    b_all, offsets = folded_b(c), slice_offsets(slices)
    b = tuple(b_all[:, offsets[i] : offsets[i + 1]].contiguous() for i in range(n))
    del b_all
    meta = P.LoRAKernelMeta.make(S, T, device=x.device)
    meta.prepare_tensors(slots)
    args = meta.meta_args(T, False)  # vLLM's default: specialize_active_lora=False

    def fn(y):
        buffer = torch.empty((n, T, r), dtype=torch.float32, device=x.device)  # as add_lora_linear
        P.lora_shrink(x, a, buffer, *args, 1.0)
        P.lora_expand(buffer, b, y, *args, offset_start=0, add_inputs=True)

    return fn, {"max_loras": S, "grid_loras": int(args[-1].item())}


def _sglang_inputs(c):
    """SGLang's pool: A [S', n*r, in] and B folded [S', out, r], a rank per slot; rows without
    an adapter use an extra slot of rank 0 (its convention for base-only requests)."""
    slots, S, r = c["token_slots"], c["num_slots"], c["rank"]
    dev = slots.device
    a, b = c["lora_a"].contiguous(), folded_b(c)
    ranks = torch.full((S,), r, dtype=torch.int32, device=dev)
    if bool((slots < 0).any()):
        a = torch.cat([a, torch.zeros_like(a[:1])])
        b = torch.cat([b, torch.zeros_like(b[:1])])
        ranks = torch.cat([ranks, torch.zeros(1, dtype=torch.int32, device=dev)])
        slots = torch.where(slots < 0, S, slots)
    scalings = torch.ones(ranks.numel(), dtype=torch.float32, device=dev)  # folded into B
    return a, b, ranks, scalings, slots.to(torch.int32)


def _sglang_segments(c, wi):
    """Requests (start, length) of the case: one row each at decode, the sequences at prefill."""
    T = wi.numel()
    if c["phase"] == "prefill":
        per_seq = T // c["seqs"]
        return [(s * per_seq, per_seq) for s in range(c["seqs"])]
    return [(t, 1) for t in range(T)]


def sglang_triton_path(c, P):
    x, slices, n = c["x"], c["slices"], len(c["slices"])
    a, b, ranks, scalings, wi = _sglang_inputs(c)
    dev, T, mlpb = x.device, x.shape[0], ranks.numel()
    if c["phase"] == "decode":
        # TritonLoRABackend._build_sgemm_routing: tokens sorted by adapter, one segment per slot.
        perm = torch.argsort(wi, stable=True).to(torch.int32)
        sorted_wi = wi[perm]
        ids = torch.arange(mlpb, dtype=torch.int32, device=dev)
        seg_lens = (torch.searchsorted(sorted_wi, ids, right=True) - torch.searchsorted(sorted_wi, ids)).to(torch.int32)
        indptr = torch.zeros(mlpb + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(seg_lens, 0)
        info = LoRABatchInfo(use_cuda_graph=False, bs=mlpb, num_segments=mlpb, seg_indptr=indptr, weight_indices=ids,
                             lora_ranks=ranks, scalings=scalings, max_len=T, seg_lens=seg_lens, permutation=perm)
    else:
        # prepare_lora_batch at extend: one segment per request, in token order.
        segs = _sglang_segments(c, wi)
        starts = torch.tensor([s for s, _ in segs], device=dev)
        seg_lens = torch.tensor([n_ for _, n_ in segs], dtype=torch.int32, device=dev)
        indptr = torch.zeros(len(segs) + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(seg_lens, 0)
        info = LoRABatchInfo(use_cuda_graph=False, bs=len(segs), num_segments=len(segs), seg_indptr=indptr,
                             weight_indices=wi[starts].contiguous(), lora_ranks=ranks, scalings=scalings,
                             max_len=max(n_ for _, n_ in segs), seg_lens=seg_lens, permutation=None)
    offsets = slice_offsets(slices)
    if n == 3:  # QKVParallelLinearWithLoRA -> run_qkv_lora
        out_offset = torch.tensor(offsets, dtype=torch.int32, device=dev)

        def fn(y):
            v = P.sgemm_lora_a(x, a, info, stack_num=3)
            P.qkv_lora_b(v, b, info, out_offset, max(slices), y, n_slices=3)
        kernels = "sgemm_lora_a + qkv_lora_b"
    elif n == 2:  # MergedColumnParallelLinearWithLoRA, equal halves -> run_gate_up_lora
        def fn(y):
            v = P.sgemm_lora_a(x, a, info, stack_num=2)
            P.gate_up_lora_b(v, b, info, slices[0], y)
        kernels = "sgemm_lora_a + gate_up_lora_b"
    else:  # RowParallelLinearWithLoRA -> run_lora_a_sgemm, run_lora_b_sgemm
        def fn(y):
            v = P.sgemm_lora_a(x, a, info)
            P.sgemm_lora_b(v, b, info, y)
        kernels = "sgemm_lora_a + sgemm_lora_b"
    return fn, {"kernels": kernels, "segments": info.num_segments, "max_len": info.max_len}


def csgmv_chunk(num_tokens: int, max_chunk: int) -> int:
    """ChunkedSgmvLoRABackend._determine_chunk_size_for_tokens."""
    if max_chunk <= 16:
        return 16
    return min(max_chunk, 128 if num_tokens >= 256 else 32 if num_tokens >= 64 else 16)


def sglang_csgmv_path(c, P, max_chunk=CSGMV_DEFAULT_CHUNK):
    x, slices, n = c["x"], c["slices"], len(c["slices"])
    a, b, ranks, scalings, wi = _sglang_inputs(c)
    dev, T = x.device, x.shape[0]
    chunk = csgmv_chunk(T, max_chunk)
    # _get_permutation / _get_segments_info: rows sorted by adapter (stable), cut in chunks.
    wi_host = wi.cpu()
    perm = torch.argsort(wi_host, stable=True)
    reordered = wi_host[perm]
    weights, counts = torch.unique_consecutive(reordered, return_counts=True)
    seg_w, seg_l = [], []
    for w, count in zip(weights.tolist(), counts.tolist()):
        k = (count + chunk - 1) // chunk
        seg_w += [w] * k
        seg_l += [chunk] * (k - 1) + [count - (k - 1) * chunk]
    indptr = torch.zeros(len(seg_l) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(seg_l, dtype=torch.int32), 0)
    segs = _sglang_segments(c, wi)
    info = LoRABatchInfo(use_cuda_graph=False, bs=len(segs), num_segments=len(seg_w), seg_indptr=indptr.to(dev),
                         weight_indices=torch.tensor(seg_w, dtype=torch.int32, device=dev), lora_ranks=ranks,
                         scalings=scalings, max_len=chunk, seg_lens=None, permutation=perm.to(torch.int32).to(dev))
    offsets = slice_offsets(slices)
    out_offset = torch.tensor(offsets, dtype=torch.int32, device=dev)
    out_offset_cpu = torch.tensor(offsets, dtype=torch.int32)
    max_slice = max(slices)

    def fn(y):
        v = P.csgmv_shrink(x, a, info, num_slices=n)
        P.csgmv_expand(v, b, info, out_offset, max_slice, y, slice_offsets_cpu=out_offset_cpu)

    return fn, {"chunk": chunk, "segments": len(seg_w)}


def v2_plan_note(plan) -> dict:
    return {"a": plan.a_family.value, "b": plan.b_family.value, "overlap": plan.overlap.value,
            "block_size": plan.block_size, "a_split_k": plan.a_tiles.get("SPLIT_K", 1),
            "a_split_mode": plan.a_tiles.get("SPLIT_MODE", "serial") if plan.a_tiles.get("SPLIT_K", 1) > 1 else None}


def _sglang_v2_runner(c, P, workspace, plan=None, architecture=None):
    """A DenseLoraRunner bound to the case's batch, its weights (B folded), the slice offsets
    and the plan (by default the one its table picks for a linear layer)."""
    slices, r = c["slices"], c["rank"]
    slots, S = c["token_slots"], c["num_slots"]
    dev, T = c["x"].device, c["x"].shape[0]
    a, b = c["lora_a"].contiguous(), folded_b(c)
    ranks = torch.full((S,), r, dtype=torch.int32, device=dev)
    scalings = torch.ones(S, dtype=torch.float32, device=dev)  # folded into B
    runner = P.v2_runner.DenseLoraRunner(workspace, max_loras=S, device=dev, architecture=architecture)
    phase = SGLangPhase.PREFILL if c["phase"] == "prefill" else SGLangPhase.DECODE
    runner.begin_batch(token_slots=slots.to(torch.int32), lora_ranks=ranks, scalings=scalings, num_tokens=T,
                       phase=phase, graph_mode=False)
    offsets = tuple(slice_offsets(slices))
    if plan is None:  # what TritonV2LoRABackend.forward_with_base asks for a linear layer
        plan = runner.plan_for(P.v2_plan.DenseLoraKind.LINEAR, b.shape[-1], a.shape[-1], offsets[-1], num_tokens=T)
    return runner, a, b, offsets, plan


def sglang_v2_path(c, P, plan=None, architecture=None):
    x, n = c["x"], len(c["slices"])
    runner, a, b, offsets, plan = _sglang_v2_runner(c, P, P.V2Workspace(), plan, architecture)

    def fn(y):
        bridge = runner.run_a(x, a, stack=n, plan=plan)
        runner.run_b(bridge, b, y, offsets=offsets, plan=plan, add_inplace=True)

    return fn, {"plan": v2_plan_note(plan), "architecture": runner.architecture}


PATHS = {
    "vllm": vllm_path,
    "sglang_triton": sglang_triton_path,
    "sglang_csgmv": sglang_csgmv_path,
    "sglang_v2": sglang_v2_path,
}


def peer_paths(c, P, wanted):
    """(name, builder) of every peer path to run on this case."""
    out = []
    for name in wanted:
        if not P.has(name):
            continue
        out.append((name, lambda c, P, f=PATHS[name]: f(c, P)))
        if name == "sglang_csgmv" and csgmv_chunk(c["x"].shape[0], CSGMV_MAX_CHUNK) != CSGMV_DEFAULT_CHUNK:
            out.append((f"sglang_csgmv_chunk{CSGMV_MAX_CHUNK}",
                        lambda c, P: sglang_csgmv_path(c, P, max_chunk=CSGMV_MAX_CHUNK)))
    return out


# --------------------------------------------------------------------------------------
# The layer measure (--layer): the whole decode layer y = x W^T + LoRA term per path.
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EngineRule:
    """What the engine runs a decode projection as (server/model.py, LlamaModel._linear and
    _uses_gemm): kernels.linear's lora_linear up to TRITON_GEMM_MAX_TOKENS rows where its
    triton_gemm is on (CUDA, a Triton backend, a device with PDL: model._overlaps), cuBLAS
    then add_lora above."""

    max_tokens: int
    source: str
    gemm_device: typing.Callable[[torch.device], bool]

    def runs_lora_linear(self, device: torch.device, num_tokens: int) -> bool:
        return self.gemm_device(device) and num_tokens <= self.max_tokens

    def meta(self) -> dict:
        return {"triton_gemm_max_tokens": self.max_tokens, "source": self.source}


def engine_rule(smoke: bool = False) -> EngineRule:
    """The rule read from server/model.py: imported (loraplex.server.model), or where that
    package will not import here, its constant read from the source and the device check
    restated (compute capability 9.0 and later). `smoke`: the GPU rule on the CPU (the
    interpreter runs lora_linear's three kernels one after the other)."""
    try:
        from loraplex.server.model import TRITON_GEMM_MAX_TOKENS as max_tokens, _overlaps as gemm_device
        source = "loraplex.server.model"
    except ImportError as exc:
        found = re.search(r"^TRITON_GEMM_MAX_TOKENS = (\d+)", (ROOT / "server" / "model.py").read_text(), re.M)
        if found is None:
            raise
        max_tokens = int(found.group(1))
        gemm_device = lambda d: d.type == "cuda" and torch.cuda.get_device_capability(d)[0] >= 9  # noqa: E731
        source = f"server/model.py read as text ({exc!r:.120})"
    if smoke:
        return EngineRule(max_tokens, source + "; smoke: as on a GPU with PDL", lambda d: True)
    return EngineRule(max_tokens, source, gemm_device)



# Layer paths: builders as above, returning fn(out), which writes the whole layer output into
# `out` (and returns it), and a note.

def ours_layer_path(c, P, rule: EngineRule, backend="auto"):
    """Exactly what the engine runs for this many rows: lora_linear (its GEMM configuration
    for the shape, as _linear leaves it to gemm_config) or cuBLAS then add_lora; output
    slices only for a fused projection, as _linear passes them."""
    x, w, a, b, sc, slices = c["x"], c["weight"], c["lora_a"], c["lora_b"], c["scaling"], c["slices"]
    S, slots, T = c["num_slots"], c["token_slots"], c["x"].shape[0]
    distinct = int(torch.unique(slots[slots >= 0]).numel())
    batch = LoRABatch.build(slots, S, max_adapters=max(distinct, 1))
    out_slices = slices if len(slices) > 1 else None
    if rule.runs_lora_linear(x.device, T):
        config = gemm_config(T, w)

        def fn(out):
            return lora_linear(x, w, a, b, sc, batch, output_slices=out_slices, out=out, config=config)

        return fn, {"runs": "lora_linear", "gemm_config": dataclasses.asdict(config)}

    def fn(out):
        torch.matmul(x, w.T, out=out)
        return add_lora(out, x, a, b, sc, batch, backend=backend, output_slices=out_slices)

    return fn, {"runs": "cublas then add_lora", "backend": backend}


def cublas_then(build):
    """A LoRA-term builder as a layer: torch.matmul (cuBLAS) into out, then the term added
    into it, one after the other on one stream."""

    def layer(c, P):
        term, note = build(c, P)
        x, w = c["x"], c["weight"]

        def fn(out):
            torch.matmul(x, w.T, out=out)
            term(out)
            return out

        return fn, {"runs": "cublas then the term", **note}

    return layer


V2_SCHEDULES = {  # runner.apply, per plan.overlap
    "a": "shrink (run_a) on the side stream beside the base GEMM; the caller waits for it, then runs the expand "
         "(run_b) into the base output",
    "ab_delta": "shrink and expand on the side stream into a zeroed delta beside the base GEMM; the caller waits, "
                "then adds the delta",
    "none": "the plan asks no overlap: base GEMM, shrink, expand on one stream (timed so)",
}


def sglang_v2_overlap_path(c, P, plan=None, architecture=None):
    """SGLang's triton_v2 layer as TritonV2LoRABackend.forward_with_base runs it: the plan its
    table picks for a linear layer, then DenseLoraRunner.apply with the base GEMM as
    base_fn (SGLang's is quant_method.apply, F.linear: cuBLAS; here torch.matmul into the
    output buffer, as the other layer paths). apply runs the plan's overlap through
    LoraWorkspace.run_parallel (side stream and events: SideStreamWorkspace); on the CPU
    run_parallel runs the side part, then the base, on one stream."""
    x, w = c["x"], c["weight"]
    ws = P.V2SideStreamWorkspace()
    runner, a, b, offsets, plan = _sglang_v2_runner(c, P, ws, plan, architecture)

    def fn(out):
        return runner.apply(x, lambda: torch.matmul(x, w.T, out=out), plan, a=a, b=b, offsets=offsets)

    def streams():  # after timing: the side streams apply used, one per calling stream
        pairs = [(caller, side.cuda_stream) for (_, caller), side in ws._streams.items()]
        return {"side_streams": len(pairs), "side_stream_never_its_caller": all(c != s for c, s in pairs) if pairs
                else None}

    schedule = V2_SCHEDULES[plan.overlap.value]
    if x.device.type != "cuda" and plan.overlap.value != "none":
        schedule += " (on the CPU run_parallel runs the side part, then the base GEMM, on one stream)"
    return fn, {"plan": v2_plan_note(plan), "architecture": runner.architecture, "overlap": plan.overlap.value,
                "schedule": schedule, "after_timing": streams}


def layer_paths(c, P, wanted, rule: EngineRule, backend="auto"):
    out = [("ours_layer", lambda c, P: ours_layer_path(c, P, rule, backend)),
           ("cublas_then_ours", cublas_then(lambda c, P: ours_path(c, P, backend=backend)))]
    out += [(f"cublas_then_{name}", cublas_then(build)) for name, build in peer_paths(c, P, wanted)]
    if P.has("sglang_v2") and "sglang_v2" in wanted:
        out.append(("sglang_v2_overlap", sglang_v2_overlap_path))
    return out
