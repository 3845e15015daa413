#!/usr/bin/env bash
# Fills .peers/ (never committed) with the peers' Triton LoRA op files that
# bench/peer_kernels.py times beside add_lora: vLLM's lora_shrink / lora_expand and
# SGLang's dense LoRA kernels (triton, csgmv and triton_v2 backends).
#
#   bench/fetch_peers.sh                                  # the latest releases
#   VLLM_VERSION=0.33.0 SGLANG_VERSION=0.5.23 bench/fetch_peers.sh   # pinned
#
# Downloads the two wheels with pip (--no-deps, into a temporary folder), extracts
# only the pure-Python files listed below (a few hundred KB, their licenses too) and
# writes .peers/VERSIONS. Then carry `.peers` to the GPU machine with the checkout.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEST="$ROOT/.peers"
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT

"$PY" -m pip download -q --no-deps --only-binary :all: -d "$WHEELS" \
    "vllm${VLLM_VERSION:+==$VLLM_VERSION}" "sglang${SGLANG_VERSION:+==$SGLANG_VERSION}"

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" - "$WHEELS" "$DEST" <<'EOF'
import re, sys, zipfile
from pathlib import Path

wheels, dest = Path(sys.argv[1]), Path(sys.argv[2])
FILES = {
    "vllm": [
        "vllm/lora/ops/triton_ops/lora_shrink_op.py",
        "vllm/lora/ops/triton_ops/lora_expand_op.py",
        "vllm/lora/ops/triton_ops/kernel_utils.py",
        "vllm/lora/ops/triton_ops/utils.py",
        "vllm/lora/ops/triton_ops/lora_kernel_metadata.py",
    ],
    "sglang": [
        # classic "triton" backend and the "csgmv" backend (SGLang's default)
        "sglang/kernels/ops/lora/dense/kernel_utils.py",
        "sglang/kernels/ops/lora/dense/sgemm_lora_a.py",
        "sglang/kernels/ops/lora/dense/sgemm_lora_b.py",
        "sglang/kernels/ops/lora/dense/qkv_lora_b.py",
        "sglang/kernels/ops/lora/dense/gate_up_lora_b.py",
        "sglang/kernels/ops/lora/dense/chunked_sgmv_shrink.py",
        "sglang/kernels/ops/lora/dense/chunked_sgmv_expand.py",
        "sglang/kernels/ops/lora/dense/lora_tuning_config.py",
        "sglang/kernels/ops/lora/dense/csgmv_configs/",
        # "triton_v2" backend: routing, grouped / per-row kernels, its plan tables
        "sglang/kernels/ops/lora/common/route_view.py",
        "sglang/kernels/ops/lora/common/routing.py",
        "sglang/kernels/ops/lora/common/lora_a.py",
        "sglang/kernels/ops/lora/common/lora_b.py",
        "sglang/srt/lora/dense/runner.py",
        "sglang/srt/lora/dense/plan.py",
        "sglang/srt/lora/dense/configs/",
        "sglang/srt/lora/workspace.py",
    ],
}
versions = {}
for package, wanted in FILES.items():
    (wheel,) = sorted(wheels.glob(f"{package}-*.whl"))
    versions[package] = re.match(rf"{package}-([^-]+)-", wheel.name).group(1)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        for want in wanted:
            hits = [n for n in names if (n.startswith(want) if want.endswith("/") else n == want)]
            hits = [n for n in hits if not n.endswith("/")]
            if not hits:
                sys.exit(f"{wheel.name} has no {want}")
            for name in hits:
                out = dest / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
        (lic,) = [n for n in names if re.match(rf"{package}-[^/]+\.dist-info/(licenses/)?LICENSE", n)]
        (dest / f"LICENSE.{package}").write_bytes(z.read(lic))
(dest / "VERSIONS").write_text("".join(f"{k}=={v}\n" for k, v in versions.items()))
print("extracted:", ", ".join(f"{k} {v}" for k, v in versions.items()))
EOF

# Never committed: keep .peers/ out of git in this clone.
if [ -d "$ROOT/.git/info" ] && ! grep -qx '/.peers/' "$ROOT/.git/info/exclude" 2>/dev/null; then
    echo '/.peers/' >> "$ROOT/.git/info/exclude"
fi
du -sh "$DEST"
cat "$DEST/VERSIONS"
