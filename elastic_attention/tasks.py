"""tasks.py — the synthetic task suite: token-level tasks that need far tokens, and tasks that don't.

The paper (METHOD.md §1, §8) sorts real tasks into two regimes: *sparsity-sensitive* ones (QA,
needle retrieval) collapse when heads lose the distant context, *sparsity-robust* ones
(summarisation, code, in-context learning) barely notice. Here each regime gets small synthetic
stand-ins, generated on the fly from a seed, that make the difference exact: a sensitive task's
evidence sits more than `window` tokens before every position that must use it, and after the
`sink` tokens, so a streaming head (kernels.streaming) cannot see it; a robust task's answer is
fully determined by the last few tokens.

Every sample has the shape of the paper's inputs (§4: the router pools the first and last
`pool_tokens` key states, so the task must show at both boundaries):

    [BOS] [4 instruction tokens of this task] [long middle ...] [query marker of this task] [query/answer]
     0     1..4                                                   S - tail                    ... S - 1

No task id is ever given to the model: the instruction tokens and the query marker differ per
task, and that is all the router has to go on. Every tail is at most MAX_TAIL = 13 tokens, so
the marker lies inside the last 16 tokens (the tiny preset's pool_tokens).

Targets follow the standard LM shift: the logits at position t predict token t + 1, so an *answer
token* at position a gives `targets[a - 1] = tokens[a]`, and `targets` is IGNORE (-100) at every
other position (in particular at S - 1, which has no next token). We call t = a - 1 a *prediction
position*; visibility and distances are always measured from prediction positions, since that is
where the model reads the context to produce the answer.

Shape letters: B batch, S sequence length, N = MAX_NEEDLES needle slots, V = VOCAB_SIZE.
"""
from dataclasses import dataclass
from functools import partial

import torch

from .masks import check_int

# -----------------------------------------------------------------------------
# Vocabulary. Disjoint ranges, so a key can never turn up by accident in the filler.

PAD, BOS, SEP, NEEDLE = 0, 1, 2, 3      # 4..7 reserved; PAD is never generated (all rows have length S)
INSTR_LEN = 4                            # instruction tokens per task, right after BOS
MAX_TASKS = 8                            # room in the vocabulary; TASKS uses 5
INSTR = range(8, 8 + MAX_TASKS * INSTR_LEN)  # 8..39: task i owns INSTR[4i : 4i + 4]
QUERY = range(40, 40 + MAX_TASKS)        # 40..47: task i's query marker is QUERY[i]
KEYS = range(48, 64)                     # 16 key symbols (recall tasks)
VALUES = range(64, 80)                   # 16 value symbols (recall answers), disjoint from keys
CONTENT = range(48, 80)                  # keys ∪ values: the 32 symbols of passkeys and patterns
NOISE = range(80, 128)                   # 48 filler symbols; never part of an answer or of evidence
VOCAB_SIZE = 128                         # Config.vocab_size must be at least this

IGNORE = -100                            # torch.nn.functional.cross_entropy's default ignore_index
PREFIX_LEN = 1 + INSTR_LEN               # BOS + instruction
MAX_NEEDLES = 8                          # needle slots per sample, padded with -1
MAX_TAIL = 13                            # longest query/answer section, marker included
MIN_WINDOW = 16                          # robust tails must fit inside one window

# Task sizes, kept small so a 4-layer, dim-128 model learns every task in minutes on a CPU.
N_PAIRS, N_QUERIES = 8, 4                # kv_recall: pairs after the instruction, queries at the end
PASSKEY_LEN = 3                          # passkey: distinct CONTENT tokens after a NEEDLE marker
PERIODIC_LEN, PERIODS = 12, (2, 3, 4)    # periodic: tokens after the marker, possible periods
COPY_LENS = (3, 4, 5)                    # local_copy: span lengths
LOCAL_PAIRS, LOCAL_QUERIES = 3, 2        # local_recall: pairs and queries, all inside the window


def default_margin(window):
    """Extra distance beyond the window that sensitive evidence keeps from every prediction
    position, so that an off-by-one in someone's mask convention cannot make it visible."""
    return max(4, window // 8)


def relay_margin(n_layers, window):
    """The margin that puts sensitive evidence at least n_layers·window tokens before its answers.
    One streaming layer sees `window` tokens back, but a stack of L of them can pass information
    back by up to L·(window − 1) tokens, token to token; beyond that no all-streaming model can
    reach the evidence, so the task truly needs a FULL head somewhere."""
    check_int("n_layers", n_layers, 1)
    return (n_layers - 1) * window


def first_free(sink):
    """First position a streaming head cannot see from far away: after the prefix and the sink."""
    return max(PREFIX_LEN, sink)


def min_seq_len(window, sink, margin=None):
    """Shortest S every task can be generated at (kv_recall is the longest-reaching layout)."""
    margin = default_margin(window) if margin is None else margin
    return first_free(sink) + 2 * N_PAIRS + (window + margin) + 2 * N_QUERIES

# -----------------------------------------------------------------------------
# Sample generators. Each writes one task into x, a (S,) long tensor that already holds BOS, the
# task's instruction and NOISE everywhere else, and returns (answer_at, needles): the positions of
# the answer tokens, and the positions of the far evidence a retrieval head must attend to (empty
# for robust tasks). `start` is first_free(sink); `reach` = window + margin is the distance the
# evidence keeps from every prediction position.


def _draw(g, symbols, k, replace):
    """k symbols from a range, with or without replacement, as a (k,) long tensor."""
    if replace:
        idx = torch.randint(len(symbols), (k,), generator=g)
    else:
        idx = torch.randperm(len(symbols), generator=g)[:k]
    return idx + symbols.start


def _randint(g, lo, hi):
    """One int uniform in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _check_far(needles, answer_at, reach, name):
    gap = (min(answer_at) - 1) - max(needles)  # first prediction position − last evidence token
    if gap < reach:
        raise ValueError(f"{name}: evidence only {gap} tokens before the first prediction position, "
                         f"need >= {reach}; increase seq_len")


def kv_recall(g, x, start, reach, marker, depth):
    """Multi-query associative recall (sensitive). N_PAIRS key–value pairs right after the
    instruction, noise, then N_QUERIES of those keys at the end, each followed by its value:

        BOS I I I I  k1 v1 … k8 v8  noise …  Q  ka va  kb vb  kc vc  kd vd
    Keys are distinct, queried keys are distinct, values are drawn with replacement (so earlier
    answers say nothing about later ones). Needles: the queried pairs' key and value positions.
    """
    S = len(x)
    keys = _draw(g, KEYS, N_PAIRS, replace=False)
    vals = _draw(g, VALUES, N_PAIRS, replace=True)
    x[start:start + 2 * N_PAIRS:2] = keys
    x[start + 1:start + 2 * N_PAIRS:2] = vals
    q = torch.randperm(N_PAIRS, generator=g)[:N_QUERIES]
    tail = S - (1 + 2 * N_QUERIES)
    x[tail] = marker
    x[tail + 1::2] = keys[q]
    x[tail + 2::2] = vals[q]
    answer_at = [tail + 2 + 2 * i for i in range(N_QUERIES)]
    needles = sorted(start + 2 * int(i) + o for i in q for o in (0, 1))
    _check_far(needles, answer_at, reach, "kv_recall")
    return answer_at, needles


def passkey(g, x, start, reach, marker, depth):
    """Needle / passkey retrieval (sensitive). NEEDLE p1 p2 p3 hidden in the noise at a depth
    between `start` and the farthest position that keeps it `reach` tokens from the end; the end
    asks for it back:

        BOS I I I I  noise … NEEDLE p1 p2 p3 … noise  Q  p1 p2 p3
    depth ∈ [0, 1] places the needle at that fraction of the allowed range (0 = right after the
    prefix and sink, 1 = as close to the question as allowed); None draws it uniformly.
    Needles: the NEEDLE marker and the passkey tokens.
    """
    S = len(x)
    key = _draw(g, CONTENT, PASSKEY_LEN, replace=False)  # distinct, so p_i → p_{i+1} is unambiguous
    tail = S - (1 + PASSKEY_LEN)  # the marker's position = the first prediction position
    hi = tail - reach - PASSKEY_LEN  # last needle start with the last passkey token `reach` back
    if hi < start:
        raise ValueError(f"passkey: no room for the needle at S={S}, need S >= {S + start - hi}")
    pos = _randint(g, start, hi) if depth is None else start + round(float(depth) * (hi - start))
    x[pos] = NEEDLE
    x[pos + 1:pos + 1 + PASSKEY_LEN] = key
    x[tail] = marker
    x[tail + 1:] = key
    answer_at = list(range(tail + 1, S))
    needles = list(range(pos, pos + 1 + PASSKEY_LEN))
    _check_far(needles, answer_at, reach, "passkey")
    return answer_at, needles


def periodic(g, x, start, reach, marker, depth):
    """Continue a local periodic pattern (robust). A pattern of p ∈ PERIODS distinct CONTENT
    symbols repeated for PERIODIC_LEN tokens after the marker:

        BOS I I I I  noise …  Q  a b c a b c a b c a b c
    Answers: every token from index p + 1 of the pattern on (once the pattern's first symbol has
    come back at index p, the period is known and the rest follows).
    """
    S = len(x)
    p = PERIODS[_randint(g, 0, len(PERIODS) - 1)]
    pattern = _draw(g, CONTENT, p, replace=False)
    tail = S - (1 + PERIODIC_LEN)
    x[tail] = marker
    x[tail + 1:] = pattern.repeat(PERIODIC_LEN // p + 1)[:PERIODIC_LEN]
    return [tail + 1 + i for i in range(p + 1, PERIODIC_LEN)], []


def local_copy(g, x, start, reach, marker, depth):
    """Copy a short span marked by the query marker and SEP (robust). k ∈ COPY_LENS distinct
    CONTENT symbols, SEP, then the same k symbols again:

        BOS I I I I  noise …  Q  s1 s2 s3 s4  SEP  s1 s2 s3 s4
    Answers: the k copied symbols (the first one is predicted at SEP).
    """
    S = len(x)
    k = COPY_LENS[_randint(g, 0, len(COPY_LENS) - 1)]
    span = _draw(g, CONTENT, k, replace=False)
    tail = S - (2 * k + 2)
    x[tail] = marker
    x[tail + 1:tail + 1 + k] = span
    x[tail + 1 + k] = SEP
    x[tail + 2 + k:] = span
    return list(range(tail + 2 + k, S)), []


def local_recall(g, x, start, reach, marker, depth):
    """Associative recall with the pairs inside the window (robust): kv_recall's mechanism, but
    the evidence is near, so only the distance separates it from the sensitive version:

        BOS I I I I  noise …  Q  k1 v1 k2 v2 k3 v3  SEP  ka va  kb vb
    """
    S = len(x)
    keys = _draw(g, KEYS, LOCAL_PAIRS, replace=False)
    vals = _draw(g, VALUES, LOCAL_PAIRS, replace=True)
    q = torch.randperm(LOCAL_PAIRS, generator=g)[:LOCAL_QUERIES]
    tail = S - (2 + 2 * LOCAL_PAIRS + 2 * LOCAL_QUERIES)
    x[tail] = marker
    x[tail + 1:tail + 1 + 2 * LOCAL_PAIRS:2] = keys
    x[tail + 2:tail + 1 + 2 * LOCAL_PAIRS:2] = vals
    x[tail + 1 + 2 * LOCAL_PAIRS] = SEP
    qs = tail + 2 + 2 * LOCAL_PAIRS  # first query key
    x[qs::2] = keys[q]
    x[qs + 1::2] = vals[q]
    return [qs + 1 + 2 * i for i in range(LOCAL_QUERIES)], []

# -----------------------------------------------------------------------------
# The task list. A task's id is its index here; it fixes the instruction tokens and the marker.


@dataclass(frozen=True)
class Task:
    task_id: int
    name: str
    category: str   # "sensitive" (needs tokens beyond the window) | "robust" (the window suffices)
    make: object    # make(g, x, start, reach, marker, depth) -> (answer_at, needles)
    chance: float   # accuracy of guessing an answer token uniformly from its alphabet
    metric: str = "accuracy"  # token_accuracy: the share of answer tokens whose argmax is right

    @property
    def instruction(self):
        return tuple(INSTR[INSTR_LEN * self.task_id:INSTR_LEN * (self.task_id + 1)])

    @property
    def marker(self):
        return QUERY[self.task_id]


TASKS = [
    Task(0, "kv_recall", "sensitive", kv_recall, 1 / len(VALUES)),
    Task(1, "passkey", "sensitive", passkey, 1 / len(CONTENT)),
    Task(2, "periodic", "robust", periodic, 1 / len(CONTENT)),
    Task(3, "local_copy", "robust", local_copy, 1 / len(CONTENT)),
    Task(4, "local_recall", "robust", local_recall, 1 / len(VALUES)),
]
TASK_NAMES = [t.name for t in TASKS]
SENSITIVE = [t.name for t in TASKS if t.category == "sensitive"]
ROBUST = [t.name for t in TASKS if t.category == "robust"]
assert len(TASKS) <= MAX_TASKS and all(t.task_id == i for i, t in enumerate(TASKS))


def get_task(name):
    for t in TASKS:
        if t.name == name:
            return t
    raise ValueError(f"unknown task {name!r}; choose from {TASK_NAMES}")

# -----------------------------------------------------------------------------
# Batches.


def split_seed(split, index, base_seed=0):
    """Seed of batch `index` of a split. Training batches get even seeds and evaluation batches
    odd ones, so held-out data is never drawn from a training seed, whatever the indices."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return 2 * (base_seed * 1_000_003 + index) + (split == "eval")


def rotate(names, index, size):
    """The task names of training batch `index`: sample i gets names[(index·size + i) mod #names],
    so consecutive batches continue the cycle and every task is trained whatever the batch size."""
    start = (index * size) % len(names)
    return [names[(start + i) % len(names)] for i in range(size)]


def make_batch(tasks, batch_size, seq_len, window, sink, *, seed=None, generator=None,
               margin=None, depth=None):
    """A batch of samples from `tasks` (a list of names; None = all of TASKS), balanced: sample i
    gets tasks[i % len(tasks)] before a seeded shuffle. Give exactly one of seed (an int) or
    generator (a torch.Generator, advanced in place). Same seed → same batch. CPU tensors:

        tokens     (B, S) long   the input ids
        targets    (B, S) long   tokens[t + 1] at prediction positions t, IGNORE elsewhere
        task_ids   (B,)   long   index into TASKS (for per-task targets, λ and reporting only)
        sensitive  (B,)   bool   TASKS[task_id].category == "sensitive"
        needle_pos (B, N) long   far-evidence positions, -1 padded (all -1 for robust tasks)
        query_pos  (B,)   long   the first prediction position = the last prompt token: the
                                 prompt is tokens[:query_pos + 1], and the retrieval score is the
                                 attention mass from query_pos onto needle_pos
    depth (passkey only): None draws needle depths uniformly; a float in [0, 1] fixes it.
    """
    specs = TASKS if tasks is None else [get_task(n) for n in tasks]
    if not specs:
        raise ValueError("tasks must be None (all) or a non-empty list of task names")
    if (seed is None) == (generator is None):
        raise ValueError("give exactly one of seed or generator")
    if seed is not None:
        check_int("seed", seed)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if window < MIN_WINDOW:
        raise ValueError(f"window {window} < MIN_WINDOW {MIN_WINDOW}: robust tails must fit in one window")
    if sink < 0:
        raise ValueError(f"sink must be >= 0, got {sink}")
    margin = default_margin(window) if margin is None else margin
    if margin < 0:   # evidence inside the window: a sensitive task a streaming head could answer
        raise ValueError(f"margin must be >= 0, got {margin}")
    if seq_len < min_seq_len(window, sink, margin):
        raise ValueError(f"seq_len {seq_len} too short for window {window}, sink {sink}, margin {margin}: "
                         f"need >= {min_seq_len(window, sink, margin)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be None or in [0, 1], got {depth}")
    g = generator if generator is not None else torch.Generator().manual_seed(seed)

    B, S = batch_size, seq_len
    order = torch.randperm(B, generator=g)
    task_ids = torch.tensor([specs[int(i) % len(specs)].task_id for i in order])  # (B,)
    tokens = torch.randint(NOISE.start, NOISE.stop, (B, S), generator=g)          # (B, S) filler
    targets = torch.full((B, S), IGNORE, dtype=torch.long)
    needle_pos = torch.full((B, MAX_NEEDLES), -1, dtype=torch.long)
    query_pos = torch.empty(B, dtype=torch.long)
    for b in range(B):
        spec = TASKS[int(task_ids[b])]
        x = tokens[b]  # a view: the generators write into the batch
        x[0] = BOS
        x[1:PREFIX_LEN] = torch.tensor(spec.instruction)
        answer_at, needles = spec.make(g, x, first_free(sink), window + margin, spec.marker, depth)
        a = torch.tensor(answer_at)
        targets[b, a - 1] = x[a]  # the LM shift: position a - 1 predicts token a
        needle_pos[b, :len(needles)] = torch.tensor(needles, dtype=torch.long)
        query_pos[b] = a.min() - 1
    sensitive = torch.tensor([TASKS[int(i)].category == "sensitive" for i in task_ids])
    return dict(tokens=tokens, targets=targets, task_ids=task_ids, sensitive=sensitive,
                needle_pos=needle_pos, query_pos=query_pos)

# -----------------------------------------------------------------------------
# Scoring.


def token_accuracy(logits, targets):
    """(B, S, V) logits, (B, S) targets (or only the scored positions: scored_positions) → (B,)
    fraction of each sample's answer tokens whose argmax is right. Samples without answer tokens
    score NaN (none are generated)."""
    answer = targets != IGNORE                                       # (B, S)
    correct = (logits.argmax(-1) == targets) & answer                # (B, S)
    n = answer.sum(1)
    return torch.where(n > 0, correct.sum(1).float() / n.clamp(min=1), torch.nan)  # (B,)


def scored_positions(targets):
    """(pos (B, K), tgt (B, K)): each row's scored (answer) positions, left-aligned, K = the most
    in any row; unused slots have pos 0 and tgt IGNORE."""
    scored = targets != IGNORE                                        # (B, S)
    K = max(int(scored.sum(1).max()), 1)
    order = torch.argsort((~scored).to(torch.int8), dim=1, stable=True)[:, :K]  # scored first, in order
    tgt = torch.gather(targets, 1, order)                             # (B, K)
    return torch.where(tgt != IGNORE, order, 0), tgt


def retrieval_scores(rows, needle_pos, n_kv_heads):
    """The retrieval score of every head (METHOD.md §8, App. C, after Wu et al. 2024): attention
    mass from the query position onto the needle tokens, averaged over prompts.

    rows (L, B, Hq, S): each head's attention probabilities at the query position (from
    Transformer.attention_rows); needle_pos (B, N), -1 padded. Returns (L, Hkv): a KV head's
    score is the mean over the query heads that share it, since they share its mode."""
    L, B, Hq, S = rows.shape
    on_needle = torch.zeros(B, S, dtype=rows.dtype, device=rows.device)
    valid = needle_pos >= 0
    on_needle.scatter_(1, needle_pos.clamp(min=0).to(rows.device), valid.to(rows.dtype).to(rows.device))
    mass = (rows * on_needle.view(1, B, 1, S)).sum(-1)              # (L, B, Hq)
    return mass.view(L, B, n_kv_heads, Hq // n_kv_heads).mean((1, 3))  # (L, Hkv)

# -----------------------------------------------------------------------------
# The suite interface: what train_router.py needs from a task suite. This module makes one for the
# synthetic tasks (suite), smollm2.py one for real text (smollm2.suite).


@dataclass(frozen=True)
class Suite:
    tasks: list             # Task-like: task_id (its index), name, category, metric ("accuracy" | "nll")
    batch: object           # batch(split, seed, names, size, seq_len) -> a make_batch dict of CPU tensors
    score: object           # score(task name, logits (B, K, V), targets (B, K)) -> (B,) per sample, at the
                            # scored positions (scored_positions) or on the whole grid (K = S)
    text: str               # what the inputs are made of, for results.json
    tokenizer: object = None  # the real-text suite's tokenizer (None here)
    # Real-text suite only: held-out test conditions, evaluated, never trained on.
    conditions: dict = None   # condition name -> the task names it holds (smollm2.CONDITIONS)
    condition_batch: object = None  # condition_batch(condition, names, size, seq_len, seed, dev) -> batch
    extra_tasks: tuple = ()   # task families that only the conditions hold

    @property
    def names(self):
        return [t.name for t in self.tasks]

    @property
    def sensitive(self):
        return [t.name for t in self.tasks if t.category == "sensitive"]

    @property
    def robust(self):
        return [t.name for t in self.tasks if t.category == "robust"]

    def task(self, name):
        for t in (*self.tasks, *self.extra_tasks):
            if t.name == name:
                return t
        raise ValueError(f"unknown task {name!r}; choose from {self.names + [t.name for t in self.extra_tasks]}")

    def sensitive_mask(self, device=None):
        """(T,) bool: which task ids are sensitive."""
        return torch.tensor([t.category == "sensitive" for t in self.tasks], device=device)


def _suite_batch(window, sink, n_layers, seq_len, split, seed, names, size, n):
    """A batch at n tokens, with the window and sink scaled from those of seq_len (a backbone
    stage's shorter inputs) and the margin that keeps a stack of streaming layers from relaying
    the evidence (relay_margin)."""
    w, s = window * n // seq_len, sink * n // seq_len
    return make_batch(names, size, n, w, s, seed=seed, margin=relay_margin(n_layers, w))


def _suite_score(name, logits, targets):
    return token_accuracy(logits, targets)


def suite(window, sink, n_layers, seq_len):
    """The synthetic suite for a model with this window, sink and depth, trained at seq_len tokens."""
    return Suite(TASKS, partial(_suite_batch, window, sink, n_layers, seq_len), _suite_score, "synthetic (tasks.py)")
