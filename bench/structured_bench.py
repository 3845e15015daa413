"""What a structured output costs a decode step on the host: the grammar's token masks,
filled for each row that has one, then applied to the logits (`structured.mask_logits`).

The engine thread fills one bitmask row per structured request every step, before sampling.
This times that for a Llama-3-sized vocabulary (a synthetic byte-level tokenizer of
--vocab tokens: the 256 bytes, then random pieces of 2-8 characters, a third of them with a
leading space, like BPE's), rows walked some tokens into a JSON schema's output, at batch
sizes of 1 to 64:

- `fill_rows`: each row's `GrammarState.fill` in turn (what `mask_logits` does);
- `fill_batch`: xgrammar's BatchGrammarMatcher filling every row on its threads;
- `mask_logits`: the whole hook on float32 CPU logits (fill, unpack, mask);
- `sampler_plain` / `sampler_grammar`: `Sampler.launch` + result without and with the rows'
  grammars, on the same CPU logits: the step's sampling cost, and what the grammars add.

Also the first compile (the vocabulary read once, then the schema) and a second schema's.
CPU only (`python3 bench/structured_bench.py --out structured.json`); needs xgrammar.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import use_checkout  # noqa: E402

use_checkout()

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
}
OTHER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "why": {"type": "string"}},
         "required": ["answer", "why"]}


def synthetic_tokenizer(path: Path, vocab: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer.json of `vocab` tokens (the last one "</s>", special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(seed)
    letters = [c for c in alphabet if c.isalnum()] + list("{}[]\":,.-_'")
    pieces = dict.fromkeys(sorted(alphabet))
    while len(pieces) < vocab - 1:
        piece = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        pieces.setdefault(("\u0120" + piece) if rng.random() < 0.33 else piece)
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def walk(state, steps: int, rng: random.Random, stop: int) -> None:
    """Move `state` on by `steps` tokens its grammar allows (random ones, a stop never)."""
    for _ in range(steps):
        allowed = [t for t in state.allowed().nonzero().flatten().tolist() if t != stop]
        if not allowed or not state.accept(rng.choice(allowed)):
            raise RuntimeError("the walk found no token to take")


VOCAB = 128256


def main() -> int:
    global VOCAB
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--walk", type=int, default=24, help="tokens each row is into its output (default 24)")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    VOCAB = args.vocab

    import torch
    import xgrammar as xgr

    from loraplex.server.sampling import Sampler, SamplingParams
    from loraplex.server.structured import Grammars, GrammarSpec, GrammarState, mask_logits
    from loraplex.server.tokenizer import Tokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_tokenizer(Path(tmp), VOCAB)
        tok = Tokenizer(tmp)
        eos = (tok.eos_token_id,)
        grammars = Grammars(tok, VOCAB, eos)
        t0 = time.perf_counter()
        compiled = grammars.compile(GrammarSpec("json", json.dumps(SCHEMA), "bench"))
        first_compile = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        grammars.compile(GrammarSpec("json", json.dumps(OTHER), "bench"))
        second_compile = (time.perf_counter() - t0) * 1e3

    rng = random.Random(1)
    sampler = Sampler()
    rows_out = []
    for b in [int(x) for x in args.batches.split(",")]:
        states = [GrammarState(compiled, eos) for _ in range(b)]
        for s in states:
            walk(s, args.walk, rng, eos[0])
        logits = torch.randn(b, VOCAB)
        words = (VOCAB + 31) // 32
        bitmask = torch.full((b, words), -1, dtype=torch.int32)
        batch = xgr.BatchGrammarMatcher()
        matchers = [s._matcher for s in states]
        params = [SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95)] * b
        seeds, counters = list(range(b)), [args.walk] * b
        row = {
            "batch": b,
            "fill_rows_ms": median_ms(lambda: [s.fill(bitmask, j) for j, s in enumerate(states)], args.repeat),
            "fill_batch_ms": median_ms(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask), args.repeat),
            "mask_logits_ms": median_ms(lambda: mask_logits(logits, list(range(b)), states, logits), args.repeat),
            "sampler_plain_ms": median_ms(
                lambda: sampler.launch(logits, params, seeds, counters).result(), args.repeat),
            "sampler_grammar_ms": median_ms(
                lambda: sampler.launch(logits, params, seeds, counters, grammars=states).result(), args.repeat),
        }
        row["fill_rows_ms_per_row"] = row["fill_rows_ms"] / b
        rows_out.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    out = {"benchmark": "structured_bench", "vocab": VOCAB, "walk_tokens": args.walk, "repeat": args.repeat,
           "torch_threads": torch.get_num_threads(), "first_compile_ms": first_compile,
           "second_compile_ms": second_compile, "rows": rows_out}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"first compile (vocabulary + schema) {first_compile:.0f} ms, another schema {second_compile:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
