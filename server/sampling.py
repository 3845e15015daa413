"""Per-request sampling for a whole batch at once: logit bias, repetition/presence/frequency
penalties, greedy, temperature, top-k, top-p, seed; and the logprobs a request asks for.

Randomness is counter-based: the noise for row r, vocabulary entry v at output step n is a
hash of (request seed, n, v). A seeded request therefore draws the same tokens whichever
batch it shares, on any device, and no generator state lives between steps. Sampling uses
the Gumbel-max form: token = argmax(log p_masked + g) with g = -log(-log u) (exactly a draw
from p_masked), so masks never renumber the noise.

Order, per row, as vLLM's sampler: raw logits -> logit_bias added, tokens outside
allowed_token_ids masked, EOS / stop tokens before min_tokens and bad_words' next tokens
(the request's `banned` tokens) masked, then the tokens its structured output's grammar does
not allow next (`structured.mask_logits`; the grammar's mask alone where the others left it
no token) -> penalties -> greedy argmax, or temperature -> min-p ->
top-k -> top-p -> Gumbel draw. Logprobs are of the raw logits (log_softmax in float32 before the bias,
penalties, temperature and masks: vLLM's default "raw_logprobs"), so they describe the model,
not the sampler: a token that a +100 bias made certain keeps its own (maybe low) logprob.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from .structured import mask_logits

_M32 = 0xFFFFFFFF
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's bound)
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by
# one near 0 (1e-40) gives inf, log_softmax then NaN, and the draw the argmax of NaNs (token 0).
GREEDY_TEMPERATURE = 1e-5
# logit_bias: at most this many tokens per request (vLLM's MAX_NUM_LOGIT_BIAS_TOKENS; OpenAI
# takes 300), each bias in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range).
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_LIMIT = 100.0
# bad_words: at most this many token sequences per request (each word tokenized with and
# without a leading space), so the engine thread's check of a row each step stays short.
MAX_BAD_WORDS = 1024


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (vLLM's)
    # EOS and stop_token_ids cannot be sampled before this many output tokens (vLLM's min_tokens).
    min_tokens: int = 0
    seed: int | None = None  # None: the engine draws one per request
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely
    presence_penalty: float = 0.0  # subtracted from a token's logit once it appears in the output
    frequency_penalty: float = 0.0  # subtracted once per appearance in the output
    # A token in the prompt or the output has its logit divided by this when positive,
    # multiplied when negative (vLLM's and transformers' repetition penalty); 1 = off.
    repetition_penalty: float = 1.0
    # The output starts with the prompt (/v1/completions `echo`): with `logprobs` k, each
    # prompt token's logprob and the k most likely there too (the first token's is None).
    # Only then may max_tokens be 0: score the prompt, generate nothing.
    echo: bool = False
    # vLLM's prompt_logprobs: each prompt token's logprob and rank, and the k most likely
    # tokens there (None: not asked), apart from echo's.
    prompt_logprobs_top: int | None = None
    # OpenAI's logit_bias: {token id: bias}, each bias added to that token's logit before the
    # penalties and sampling (-100 in effect bans the token, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words as token sequences (tokenizer.bad_words_token_ids): a sequence's last
    # token may not be sampled where the output ends in the rest of it (a one-token word: never).
    bad_words_ids: list[tuple[int, ...]] = field(default_factory=list)
    # vLLM's include_stop_str_in_output: the stop string (or a stop token's text) that ended
    # the request stays in its text, and streamed text is not held back for stop strings.
    include_stop_str_in_output: bool = False
    # vLLM's skip_special_tokens: False keeps special tokens' text (<|eot_id|>, say) in the output.
    skip_special_tokens: bool = True
    # Structured output: the compiled grammar (`structured.Grammars.compile`) the output must
    # match; each request of it walks the grammar with a `GrammarState` of its own.
    grammar: object | None = field(default=None, repr=False, compare=False)
    # stop_token_ids as a set: the engine thread checks every sampled token against it (a
    # list of a million ids cost each of the request's steps 26 ms).
    stop_ids: frozenset = field(init=False, repr=False, compare=False, default=frozenset())
    # logit_bias as arrays, made once: int64 [k] token ids, float32 [k] biases (empty without).
    bias_ids: np.ndarray = field(init=False, repr=False, compare=False, default=None)
    bias_values: np.ndarray = field(init=False, repr=False, compare=False, default=None)
    # allowed_token_ids as an int64 array (None without).
    allowed_ids: np.ndarray | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.stop_token_ids)
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in bias):
            raise ValueError("logit_bias keys must be token ids (integers >= 0)")
        if not all(-LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT for b in bias.values()):
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        self.bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self.bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must name at least one token")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be token ids (integers >= 0)")
            self.allowed_ids = np.unique(np.asarray(self.allowed_token_ids, dtype=np.int64))
        if len(self.bad_words_ids) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} token sequences")
        self.bad_words_ids = [tuple(w) for w in self.bad_words_ids if w]
        if self.max_tokens < (0 if self.echo else 1):
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 or positive")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs_top is not None and not 0 <= self.prompt_logprobs_top <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError("repetition_penalty must be greater than 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the request wants (None: no prompt logprobs): echo's
        (its `logprobs`), or prompt_logprobs_top's, the larger where both ask."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs_top) if k is not None]
        return max(asked) if asked else None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's logprob and the `logprobs` most likely tokens, e.g. for k = 2:
    TokenLogprobs(logprob=-1.7, top=((17, -0.4), (301, -1.2)))  # sampled token not in the top 2."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    # The token's rank in the distribution, vLLM's: how many tokens are at least as likely
    # (1 = the most likely). Set for prompt tokens (prompt_logprobs reports it); None elsewhere.
    rank: int | None = None


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of host values on `device`, sent without waiting for the device's queue
    (a plain `torch.tensor(..., device=cuda)` synchronises the stream first: it would wait for
    a look-ahead decode step queued behind the sampling)."""
    t = torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True) if device.type == "cuda" else t


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1), float32 [n, vocab], a pure function of (seed, counter, vocab index).

    seeds, counters: int64 [n] (seeds any int64: the hash reads their two's complement bits)."""
    key = _fmix32((seeds & _M32) ^ 0x9E3779B9)
    key = _fmix32(key ^ ((seeds >> 32) & _M32))
    key = _fmix32(key ^ (counters & _M32))
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _fmix32(key[:, None] ^ ((idx * 0x9E3779B1) & _M32)[None, :])
    h = _fmix32(h ^ 0x5BD1E995)
    # 24 high bits -> float32 exactly, centred in its bucket: never 0, never 1.
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k then top-p drop. logits float32 [n, V] (already divided by
    the temperature), top_k int64 [n] (<= 0 = off), top_p float32 [n]. Returns a new tensor."""
    n, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    # Top-k keeps every token at least as likely as the k-th (ties with it too), as vLLM and
    # transformers do: a value threshold, not the first k of the sort.
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(1, vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first one always stays.
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_logit_bias(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """logits float32 [N, V] with params[j].logit_bias added to row rows[j]; a new tensor (the
    input may be the decode graph's output buffer). One scatter of every row's biases, their
    flat indices built on the host from the arrays each request made once, e.g. rows [0, 2],
    V 10, biases {3: 5.0} and {1: -100.0, 7: 2.0} -> indices [3, 21, 27], values [5, -100, 2].
    Ids past the vocabulary are dropped (the engine refuses them at the request)."""
    vocab = logits.shape[-1]
    ids = [p.bias_ids for p in params]
    keep = [t < vocab for t in ids]
    flat = np.concatenate([r * vocab + t[k] for r, t, k in zip(rows, ids, keep)])
    values = np.concatenate([p.bias_values[k] for p, k in zip(params, keep)])
    out = logits.clone(memory_format=torch.contiguous_format)
    device = logits.device
    send = (lambda a: torch.from_numpy(a).to(device, non_blocking=True)) if device.type == "cuda" \
        else torch.from_numpy
    out.view(-1).index_add_(0, send(flat), send(values).to(out.dtype))
    return out


def apply_allowed_tokens(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """logits float32 [N, V] with every token but params[j].allowed_ids at -inf in row rows[j]
    (vLLM's allowed_token_ids); a new tensor. One mask of the rows, from flat indices built on
    the host, e.g. rows [1], V 4, allowed [0, 2] -> row 1 becomes [l0, -inf, l2, -inf].
    Ids past the vocabulary are dropped (the API refuses them at the request)."""
    vocab = logits.shape[-1]
    device = logits.device
    ids = [p.allowed_ids[p.allowed_ids < vocab] for p in params]
    flat = np.concatenate([j * vocab + t for j, t in enumerate(ids)])
    send = (lambda a: torch.from_numpy(a).to(device, non_blocking=True)) if device.type == "cuda" \
        else torch.from_numpy
    keep = torch.zeros(len(rows) * vocab, dtype=torch.bool, device=device)
    keep[send(flat)] = True
    index = send(np.asarray(rows, dtype=np.int64))
    out = logits.clone(memory_format=torch.contiguous_format)
    out[index] = out[index].masked_fill(~keep.view(len(rows), vocab), float("-inf"))
    return out


def _token_counts(token_lists: list, vocab: int, device: torch.device) -> torch.Tensor:
    """float32 [n, vocab]: how often each token occurs in each list (Python lists of ids, or
    int64 arrays); one scatter of all of them."""
    n = len(token_lists)
    lengths = [len(g) for g in token_lists]
    # Flat indices into counts [n * V], built on the host with numpy (it reads Python lists
    # faster than torch.tensor does; arrays are joined as they are), and one copy sends them.
    if any(isinstance(g, np.ndarray) for g in token_lists):
        tokens = np.concatenate([np.asarray(g, dtype=np.int64) for g in token_lists])
    else:
        tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    flat = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64) * vocab, lengths) + tokens)
    flat = flat.to(device, non_blocking=True)
    counts = torch.zeros(n * vocab, dtype=torch.float32, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts.view(n, vocab)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, generated: list[list[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, prompts: list | None = None,
                    repetition: torch.Tensor | None = None) -> torch.Tensor:
    """The repetition penalty, then OpenAI's presence and frequency penalties, for the rows
    that use them; a new tensor.

    logits float32 [N, V]; rows int64 [n] (distinct), the logits row of each penalised
    request; generated[j] the output tokens of request j so far; presence, frequency float32
    [n]; with `repetition` float32 [n], prompts[j] the prompt of request j (its ids, or its
    distinct ids as an int64 array). Row rows[j] gets, for every token t, first (when t is in
    prompts[j] or generated[j])
        logits[t] = logits[t] / repetition[j] if logits[t] > 0 else logits[t] * repetition[j]
    then
        logits[t] -= frequency[j] * count(t in generated[j]) + presence[j] * (count > 0)
    The counts are one scatter of all rows' tokens into a [n, V] tensor."""
    vocab = logits.shape[-1]
    counts = _token_counts(generated, vocab, logits.device)
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0).float()
    if repetition is None:
        return logits.index_add(0, rows, penalty, alpha=-1)
    seen = (counts > 0) | (_token_counts(prompts or [[]] * len(generated), vocab, logits.device) > 0)
    sub = logits[rows]
    factor = torch.where(seen, repetition[:, None], torch.ones_like(sub))
    sub = torch.where(sub > 0, sub / factor, sub * factor)
    return logits.index_copy(0, rows, sub - penalty)


@dataclass
class Sampled:
    """One batch's sampling, queued on the device (Sampler.launch): `tokens` holds the
    sampled token of logits row r at index r (rows nobody samples hold argmax tokens). Its
    copies to the host are queued too, behind an event; `result` waits for that event only,
    not for work queued on the device after the sampling (a look-ahead decode step)."""

    rows: list[int]
    params: list[SamplingParams]
    tokens: torch.Tensor  # int64 [logits rows], on the logits' device
    _tokens: torch.Tensor  # its copy on the host (pinned, filled once `_done`)
    _wanted: list[int]
    _chosen: torch.Tensor | None
    _top_values: torch.Tensor | None
    _top_indices: torch.Tensor | None
    _done: torch.cuda.Event | None

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per request, and its logprobs where the request asked (None where not)."""
        if self._done is not None:
            self._done.synchronize()
        out = self._tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(self.params)
        if self._wanted:
            chosen = self._chosen.tolist()
            top_v = self._top_values.tolist() if self._top_values is not None else [[] for _ in self._wanted]
            top_i = self._top_indices.tolist() if self._top_indices is not None else [[] for _ in self._wanted]
            for j, i in enumerate(self._wanted):
                n = self.params[i].logprobs
                logprobs[i] = TokenLogprobs(chosen[j], tuple(zip(top_i[j][:n], top_v[j][:n])))
        return [out[r] for r in self.rows], logprobs


class Sampler:
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               counters: list[int], rows: list[int] | None = None, generated: list[list[int]] | None = None,
               prompts: list | None = None, banned: list | None = None,
               grammars: list | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per request, and its logprobs where the request asks for them (None where
        it does not): `launch`, then its result."""
        return self.launch(logits, params, seeds, counters, rows, generated, prompts, banned, grammars).result()

    def launch(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               counters: list[int], rows: list[int] | None = None, generated: list[list[int]] | None = None,
               prompts: list | None = None, banned: list | None = None,
               grammars: list | None = None) -> Sampled:
        """Queue the sampling on the logits' device, and the copies of what the host reads
        back, with no synchronisation: `Sampled.result` waits for them.

        logits float32 [n, V]; request i reads row rows[i] (default i); `seeds` and
        `counters` (the request's output-token index) feed the noise; generated[i] (its
        output tokens so far) feeds the penalties, and prompts[i] (its prompt's ids, or their
        distinct ids as an int64 array; None without a repetition penalty) the repetition penalty.
        `logits` is read, never written (on CUDA it is the decode graph's output buffer).
        params[i].logit_bias is added to its row first. banned[i]: token ids request i may not
        sample this step (EOS and stop_token_ids before its min_tokens); empty or None for most.
        grammars[i]: request i's `structured.GrammarState` (None for most): only the tokens
        its grammar allows next may be sampled."""
        rows = list(range(len(params))) if rows is None else rows
        device = logits.device
        raw = logits
        generated = generated or [[] for _ in params]
        prompts = prompts or [None for _ in params]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:  # a copy, the biases added to their rows only; the others as they were
            logits = apply_logit_bias(logits, [rows[i] for i in biased], [params[i] for i in biased])
        # What a grammar's row falls back to where the masks below leave it no token its
        # grammar allows: its grammar then wins over them (the output still matches it).
        unmasked = logits
        held = [i for i, g in enumerate(grammars or ()) if g is not None]
        allowed = [i for i, p in enumerate(params) if p.allowed_ids is not None]
        if allowed:  # every other token at -inf in those rows, in a copy
            logits = apply_allowed_tokens(logits, [rows[i] for i in allowed], [params[i] for i in allowed])
        if banned and any(banned):
            # Those tokens at -inf in their rows, in a copy (the input is the graph's buffer).
            vocab = logits.shape[-1]
            pairs = [(rows[i], t) for i, ids in enumerate(banned) for t in ids or () if 0 <= t < vocab]
            # (a grammar's fallback is kept unbanned too)
            logits = logits.clone() if logits is raw or (held and logits is unmasked) else logits
            logits[to_device([r for r, _ in pairs], torch.int64, device),
                   to_device([t for _, t in pairs], torch.int64, device)] = float("-inf")
        if held:  # the tokens the grammars do not allow at -inf in their rows, in a copy
            logits = mask_logits(logits, [rows[i] for i in held], [grammars[i] for i in held], unmasked)
        # A row is penalised once it has tokens to penalise: its output, or (repetition) its prompt.
        penalised = [i for i, p in enumerate(params) if p.penalised and (
            generated[i] or (p.repetition_penalty != 1 and prompts[i] is not None and len(prompts[i])))]
        if penalised:  # no row uses them: no count tensor, no copy of the logits
            repetition = [params[i].repetition_penalty for i in penalised]
            logits = apply_penalties(
                logits, to_device([rows[i] for i in penalised], torch.int64, device),
                [generated[i] for i in penalised],
                to_device([params[i].presence_penalty for i in penalised], torch.float32, device),
                to_device([params[i].frequency_penalty for i in penalised], torch.float32, device),
                # only the rows that use it scatter their prompts (a prompt may be long)
                [prompts[i] if r != 1 and prompts[i] is not None else [] for i, r in zip(penalised, repetition)],
                to_device(repetition, torch.float32, device) if any(r != 1 for r in repetition) else None)
        tokens = logits.argmax(dim=-1)
        picked = [i for i, p in enumerate(params) if not p.greedy]
        if picked:
            idx = to_device([rows[i] for i in picked], torch.int64, device)
            sub = logits[idx]
            temps = to_device([params[i].temperature for i in picked], torch.float32, device)
            sub = sub / temps[:, None]
            if any(params[i].min_p > 0 for i in picked):
                # Before top-k and top-p, as vLLM's sampler orders them: top-p then measures
                # the mass of what min-p kept.
                min_p = to_device([params[i].min_p for i in picked], torch.float32, device)
                probs = torch.softmax(sub, dim=-1)
                sub = sub.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
            if any(params[i].top_k > 0 or params[i].top_p < 1 for i in picked):
                # A top_k past the vocabulary keeps every token; clamped, any int a request
                # sends fits the int64 tensor (10**20 would not, and would stop the engine).
                vocab = logits.shape[-1]
                top_k = to_device([min(params[i].top_k, vocab) for i in picked], torch.int64, device)
                top_p = to_device([params[i].top_p for i in picked], torch.float32, device)
                sub = apply_top_k_top_p(sub, top_k, top_p)
            u = uniform_noise(to_device([seeds[i] for i in picked], torch.int64, device),
                              to_device([counters[i] for i in picked], torch.int64, device),
                              logits.shape[-1])
            gumbel = -torch.log(-torch.log(u))
            tokens[idx] = (torch.log_softmax(sub, dim=-1) + gumbel).argmax(dim=-1)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        chosen = top = None
        if wanted:
            idx = to_device([rows[i] for i in wanted], torch.int64, device)
            lp = torch.log_softmax(raw[idx].float(), dim=-1)  # [w, V]
            chosen = lp.gather(1, tokens[idx][:, None])[:, 0]
            k = max(params[i].logprobs for i in wanted)
            top = lp.topk(k, dim=-1) if k else None  # sorted, most likely first
        cuda = device.type == "cuda"
        to_host = (lambda t: t.to("cpu", non_blocking=True)) if cuda else (lambda t: t)
        done = None
        host = [to_host(t) if t is not None else None
                for t in (tokens, chosen, *((top.values, top.indices) if top is not None else (None, None)))]
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return Sampled(rows, params, tokens, host[0], wanted, host[1], host[2], host[3], done)
