"""Tests of the synthetic task suite (tasks.py): answers sit where the LM shift says, batches are
reproducible, sensitive evidence is invisible to a streaming head, and two rule-based oracles show
the split — an induction "head" restricted to what a streaming head sees solves every robust task
and no sensitive one, while the same rule with full causal visibility solves everything."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import masks
import tasks as T

EXPECTED_ANSWERS = {  # answer tokens per sample, per task
    "kv_recall": {T.N_QUERIES},
    "passkey": {T.PASSKEY_LEN},
    "periodic": {T.PERIODIC_LEN - (p + 1) for p in T.PERIODS},
    "local_copy": set(T.COPY_LENS),
    "local_recall": {T.LOCAL_QUERIES},
}


@st.composite
def layouts(draw):
    """(seq_len, window, sink, seed), from the shortest allowed length up; small windows and odd
    lengths included."""
    window = draw(st.integers(T.MIN_WINDOW, 80))
    sink = draw(st.integers(0, 24))
    lo = T.min_seq_len(window, sink)
    seq_len = draw(st.integers(lo, lo + 300))
    return seq_len, window, sink, draw(st.integers(0, 2**31 - 1))


def batch(seq_len, window, sink, seed, batch_size=10, **kw):
    return T.make_batch(None, batch_size, seq_len, window, sink, seed=seed, **kw)


def prediction_positions(targets_row):
    return (targets_row != T.IGNORE).nonzero().flatten().tolist()


def streaming_row(t, seq_len, sink, window):
    """(S,) bool: which keys a streaming head at query position t sees (the project's predicate)."""
    j = torch.arange(seq_len)
    return masks.streaming(sink, window)(None, None, t, j)


def causal_row(t, seq_len):
    return masks.causal(None, None, t, torch.arange(seq_len))

# -----------------------------------------------------------------------------
# Layout: the LM shift, the boundaries the router pools, the vocabulary ranges.


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_targets_are_the_next_token_at_answer_positions_only(layout):
    b = batch(*layout)
    tokens, targets = b["tokens"], b["targets"]
    B, S = tokens.shape
    answer = targets != T.IGNORE
    # Position t predicts token t + 1: the convention every loss and accuracy relies on.
    assert torch.equal(targets[:, :-1][answer[:, :-1]], tokens[:, 1:][answer[:, :-1]])
    assert not answer[:, -1].any(), "the last position has no next token"
    for i in range(B):
        spec = T.TASKS[int(b["task_ids"][i])]
        pos = prediction_positions(targets[i])
        assert len(pos) in EXPECTED_ANSWERS[spec.name], spec.name
        assert b["query_pos"][i] == pos[0]
        answers = tokens[i, torch.tensor(pos) + 1]
        assert ((answers >= T.CONTENT.start) & (answers < T.CONTENT.stop)).all(), "answers are content symbols"
        assert pos[0] >= S - T.MAX_TAIL, "the query/answer section is the tail"
    assert tokens.min() >= 0 and tokens.max() < T.VOCAB_SIZE


@settings(max_examples=20, deadline=None)
@given(layouts())
def test_boundaries_identify_the_task(layout):
    """No task id is given, but the first PREFIX_LEN tokens are the task's instruction and the
    last 16 tokens (the tiny preset's pool_tokens) hold its query marker and no other task's."""
    b = batch(*layout)
    tokens = b["tokens"]
    for i in range(tokens.shape[0]):
        spec = T.TASKS[int(b["task_ids"][i])]
        assert tokens[i, :T.PREFIX_LEN].tolist() == [T.BOS, *spec.instruction]
        tail = tokens[i, -16:].tolist()
        assert spec.marker in tail
        assert not any(m in tail for m in T.QUERY if m != spec.marker)
        body = tokens[i, T.PREFIX_LEN:]
        in_instr = (body >= T.INSTR.start) & (body < T.INSTR.stop)
        assert not in_instr.any() and (body == T.BOS).sum() == 0
        assert (body == spec.marker).sum() == 1, "the marker appears once, at the start of the tail"
    prefixes = {tuple(T.TASKS[i].instruction) for i in range(len(T.TASKS))}
    assert len(prefixes) == len(T.TASKS)


def test_batches_are_balanced_and_labelled():
    b = T.make_batch(None, 20, 200, 32, 4, seed=3)
    counts = torch.bincount(b["task_ids"], minlength=len(T.TASKS))
    assert counts.tolist() == [4] * len(T.TASKS)
    sensitive = torch.tensor([T.TASKS[int(i)].category == "sensitive" for i in b["task_ids"]])
    assert torch.equal(b["sensitive"], sensitive)
    b = T.make_batch(["periodic"], 3, 200, 32, 4, seed=3)
    assert (b["task_ids"] == T.get_task("periodic").task_id).all()
    # Each task is in exactly one of the two categories (a misspelt category would drop it from
    # both), and each category has tasks: the experiment gives each its own sparsity target.
    assert sorted(T.SENSITIVE + T.ROBUST) == sorted(T.TASK_NAMES), (T.SENSITIVE, T.ROBUST)
    assert T.SENSITIVE and T.ROBUST

# -----------------------------------------------------------------------------
# Reproducibility and the held-out split.


@settings(max_examples=10, deadline=None)
@given(layouts())
def test_same_seed_same_batch(layout):
    a, b = batch(*layout), batch(*layout)
    assert all(torch.equal(a[k], b[k]) for k in a)
    seq_len, window, sink, seed = layout
    c = batch(seq_len, window, sink, seed + 1)
    assert not torch.equal(a["tokens"], c["tokens"])


def test_generator_advances_and_matches_seed():
    g = torch.Generator().manual_seed(7)
    first = T.make_batch(None, 8, 150, 32, 4, generator=g)
    second = T.make_batch(None, 8, 150, 32, 4, generator=g)
    assert not torch.equal(first["tokens"], second["tokens"])
    assert torch.equal(first["tokens"], T.make_batch(None, 8, 150, 32, 4, seed=7)["tokens"])


def test_eval_seeds_never_collide_with_train_seeds():
    train = {T.split_seed("train", i, base) for i in range(2000) for base in range(4)}
    held_out = {T.split_seed("eval", i, base) for i in range(2000) for base in range(4)}
    assert not train & held_out

# -----------------------------------------------------------------------------
# Sensitive evidence is out of a streaming head's reach.


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_evidence_is_outside_every_window_and_after_the_sink(layout):
    seq_len, window, sink, seed = layout
    b = batch(*layout)
    reach = window + T.default_margin(window)
    for i in range(b["tokens"].shape[0]):
        spec = T.TASKS[int(b["task_ids"][i])]
        needles = [j for j in b["needle_pos"][i].tolist() if j >= 0]
        if spec.category == "robust":
            assert not needles
            continue
        assert needles and all(j >= sink and j >= T.PREFIX_LEN for j in needles)
        pos = prediction_positions(b["targets"][i])
        for t in pos:
            assert all(t - j >= reach for j in needles), (spec.name, t, needles)
            assert not streaming_row(t, seq_len, sink, window)[needles].any()
        # The needles really are the evidence: every answer token is written at a needle position.
        answers = set(b["tokens"][i, torch.tensor(pos) + 1].tolist())
        assert answers <= set(b["tokens"][i, needles].tolist())


def test_passkey_depth_sweeps_from_the_sink_to_the_window_edge():
    seq_len, window, sink = 300, 32, 4
    reach = window + T.default_margin(window)
    starts = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        b = T.make_batch(["passkey"], 2, seq_len, window, sink, seed=0, depth=depth)
        starts.append(int(b["needle_pos"][0, 0]))
        last_needle = int(b["needle_pos"][0, T.PASSKEY_LEN])
        if depth == 1.0:
            assert int(b["query_pos"][0]) - last_needle == reach  # as close as allowed, no closer
    assert starts[0] == T.first_free(sink) and starts == sorted(starts) and len(set(starts)) == 5

# -----------------------------------------------------------------------------
# Oracles: one induction rule, two visibilities.


def induction_oracle(tokens, t, visible):
    """Predict token t + 1 from the keys in `visible` only, as an idealised induction head would:
    find the latest visible j < t - 1 whose token is the trigger (the current token; at a query
    marker or SEP, the token that opened the span to recall) and whose successor j + 1 is also
    visible, and copy tokens[j + 1]. Returns None when nothing visible matches."""
    cur = int(tokens[t])
    trigger = {T.get_task("passkey").marker: T.NEEDLE, T.SEP: T.get_task("local_copy").marker}.get(cur, cur)
    j = torch.arange(len(tokens) - 1)
    match = (tokens[:-1] == trigger) & visible[:-1] & visible[1:] & (j + 1 < t)
    hits = match.nonzero().flatten()
    return int(tokens[hits[-1] + 1]) if len(hits) else None


def oracle_accuracy(b, window, sink, streaming_only):
    """Per-task accuracy of the induction oracle over a batch, with causal or streaming visibility,
    and per task the fraction of answers for which it found any visible evidence at all. Without
    evidence it guesses a fixed symbol, which is right at the chance rate."""
    S = b["tokens"].shape[1]
    correct, found, total = {}, {}, {}
    for i in range(b["tokens"].shape[0]):
        name = T.TASKS[int(b["task_ids"][i])].name
        for t in prediction_positions(b["targets"][i]):
            visible = streaming_row(t, S, sink, window) if streaming_only else causal_row(t, S)
            guess = induction_oracle(b["tokens"][i], t, visible)
            correct[name] = correct.get(name, 0) + ((T.VALUES.start if guess is None else guess)
                                                    == int(b["targets"][i, t]))
            found[name] = found.get(name, 0) + (guess is not None)
            total[name] = total.get(name, 0) + 1
    return {n: correct[n] / total[n] for n in total}, {n: found[n] / total[n] for n in total}


@settings(max_examples=15, deadline=None)
@given(layouts())
def test_oracles_solve_robust_tasks_from_the_window_and_everything_with_full_view(layout):
    seq_len, window, sink, seed = layout
    b = batch(*layout)
    dense, _ = oracle_accuracy(b, window, sink, streaming_only=False)
    assert all(acc == 1.0 for acc in dense.values()), dense
    local, _ = oracle_accuracy(b, window, sink, streaming_only=True)
    assert all(local[n] == 1.0 for n in T.ROBUST), local


@pytest.mark.parametrize("seq_len, window, sink", [(256, 32, 4), (200, 16, 0), (700, 128, 32)])
def test_streaming_oracle_cannot_beat_chance_on_sensitive_tasks(seq_len, window, sink):
    b = T.make_batch(T.SENSITIVE, 120, seq_len, window, sink, seed=11)
    local, found = oracle_accuracy(b, window, sink, streaming_only=True)
    dense, _ = oracle_accuracy(b, window, sink, streaming_only=False)
    for name in T.SENSITIVE:
        assert dense[name] == 1.0
        assert found[name] == 0.0, "a streaming view must hold no copy of the evidence"
        # ~4 % margin: 360-480 answer tokens per task, so 3 standard errors of a 1/16 guess rate.
        assert local[name] <= T.get_task(name).chance + 0.04, (name, local[name])

# -----------------------------------------------------------------------------
# Scoring helpers.


def test_answer_accuracy_counts_argmax_hits_over_answer_tokens_only():
    targets = torch.full((2, 5), T.IGNORE)
    targets[0, 1], targets[0, 3] = 7, 9
    targets[1, 0] = 4
    logits = torch.zeros(2, 5, T.VOCAB_SIZE)
    logits[0, 1, 7] = 1.0   # right
    logits[0, 3, 8] = 1.0   # wrong
    logits[1, 0, 4] = 1.0   # right
    logits[:, 2, 5] = 9.0   # a non-answer position, ignored whatever it predicts
    acc = T.answer_accuracy(logits, targets)
    assert acc.tolist() == [0.5, 1.0]


def test_perfect_logits_score_one_on_a_real_batch():
    b = T.make_batch(None, 10, 200, 32, 4, seed=0)
    safe = b["targets"].clamp(min=0)
    logits = torch.nn.functional.one_hot(safe, T.VOCAB_SIZE).float()  # (B, S, V)
    assert (T.answer_accuracy(logits, b["targets"]) == 1.0).all()

# -----------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("kwargs, message", [
    (dict(tasks=["nope"]), "unknown task"),
    (dict(tasks=[]), "non-empty"),
    (dict(window=8), "MIN_WINDOW"),
    (dict(seq_len=60), "too short"),
    (dict(sink=-1), "sink"),
    (dict(batch_size=0), "batch_size"),
    (dict(depth=1.5), "depth"),
    (dict(seed=None), "exactly one"),
    (dict(generator=torch.Generator()), "exactly one"),
])
def test_bad_input_is_refused(kwargs, message):
    args = dict(tasks=None, batch_size=4, seq_len=256, window=32, sink=4, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        T.make_batch(**args)
