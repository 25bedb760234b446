"""Tests of the synthetic task suite (tasks.py): answers sit where the LM shift says, batches are
reproducible, sensitive evidence is invisible to a streaming head, and two rule-based oracles show
the split — an induction "head" restricted to what a streaming head sees solves every robust task
and no sensitive one, while the same rule with full causal visibility solves everything."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from elastic_attention import masks
from elastic_attention import tasks
EXPECTED_ANSWERS = {  # answer tokens per sample, per task
    "kv_recall": {tasks.N_QUERIES},
    "passkey": {tasks.PASSKEY_LEN},
    "periodic": {tasks.PERIODIC_LEN - (p + 1) for p in tasks.PERIODS},
    "local_copy": set(tasks.COPY_LENS),
    "local_recall": {tasks.LOCAL_QUERIES},
}


@st.composite
def layouts(draw):
    """(seq_len, window, sink, seed), from the shortest allowed length up; small windows and odd
    lengths included."""
    window = draw(st.integers(tasks.MIN_WINDOW, 80))
    sink = draw(st.integers(0, 24))
    lo = tasks.min_seq_len(window, sink)
    seq_len = draw(st.integers(lo, lo + 300))
    return seq_len, window, sink, draw(st.integers(0, 2**31 - 1))


def batch(seq_len, window, sink, seed, batch_size=10, **kw):
    return tasks.make_batch(None, batch_size, seq_len, window, sink, seed=seed, **kw)


def prediction_positions(targets_row):
    return (targets_row != tasks.IGNORE).nonzero().flatten().tolist()


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
    answer = targets != tasks.IGNORE
    # Position t predicts token t + 1: the convention every loss and accuracy relies on.
    assert torch.equal(targets[:, :-1][answer[:, :-1]], tokens[:, 1:][answer[:, :-1]])
    assert not answer[:, -1].any(), "the last position has no next token"
    for i in range(B):
        spec = tasks.TASKS[int(b["task_ids"][i])]
        pos = prediction_positions(targets[i])
        assert len(pos) in EXPECTED_ANSWERS[spec.name], spec.name
        assert b["query_pos"][i] == pos[0]
        answers = tokens[i, torch.tensor(pos) + 1]
        assert ((answers >= tasks.CONTENT.start) & (answers < tasks.CONTENT.stop)).all(), "answers are content symbols"
        assert pos[0] >= S - tasks.MAX_TAIL, "the query/answer section is the tail"
    assert tokens.min() >= 0 and tokens.max() < tasks.VOCAB_SIZE


@settings(max_examples=20, deadline=None)
@given(layouts())
def test_boundaries_identify_the_task(layout):
    """No task id is given, but the first PREFIX_LEN tokens are the task's instruction and the
    last 16 tokens (the tiny preset's pool_tokens) hold its query marker and no other task's."""
    b = batch(*layout)
    tokens = b["tokens"]
    for i in range(tokens.shape[0]):
        spec = tasks.TASKS[int(b["task_ids"][i])]
        assert tokens[i, :tasks.PREFIX_LEN].tolist() == [tasks.BOS, *spec.instruction]
        tail = tokens[i, -16:].tolist()
        assert spec.marker in tail
        assert not any(m in tail for m in tasks.QUERY if m != spec.marker)
        body = tokens[i, tasks.PREFIX_LEN:]
        in_instr = (body >= tasks.INSTR.start) & (body < tasks.INSTR.stop)
        assert not in_instr.any() and (body == tasks.BOS).sum() == 0
        assert (body == spec.marker).sum() == 1, "the marker appears once, at the start of the tail"
    prefixes = {tuple(tasks.TASKS[i].instruction) for i in range(len(tasks.TASKS))}
    assert len(prefixes) == len(tasks.TASKS)


def test_batches_are_balanced_and_labelled():
    b = tasks.make_batch(None, 20, 200, 32, 4, seed=3)
    counts = torch.bincount(b["task_ids"], minlength=len(tasks.TASKS))
    assert counts.tolist() == [4] * len(tasks.TASKS)
    sensitive = torch.tensor([tasks.TASKS[int(i)].category == "sensitive" for i in b["task_ids"]])
    assert torch.equal(b["sensitive"], sensitive)
    b = tasks.make_batch(["periodic"], 3, 200, 32, 4, seed=3)
    assert (b["task_ids"] == tasks.get_task("periodic").task_id).all()
    # Each task is in exactly one of the two categories (a misspelt category would drop it from
    # both), and each category has tasks: the experiment gives each its own sparsity target.
    assert sorted(tasks.SENSITIVE + tasks.ROBUST) == sorted(tasks.TASK_NAMES), (tasks.SENSITIVE, tasks.ROBUST)
    assert tasks.SENSITIVE and tasks.ROBUST

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
    first = tasks.make_batch(None, 8, 150, 32, 4, generator=g)
    second = tasks.make_batch(None, 8, 150, 32, 4, generator=g)
    assert not torch.equal(first["tokens"], second["tokens"])
    assert torch.equal(first["tokens"], tasks.make_batch(None, 8, 150, 32, 4, seed=7)["tokens"])


def test_eval_seeds_never_collide_with_train_seeds():
    train = {tasks.split_seed("train", i, base) for i in range(2000) for base in range(4)}
    held_out = {tasks.split_seed("eval", i, base) for i in range(2000) for base in range(4)}
    assert not train & held_out

# -----------------------------------------------------------------------------
# Sensitive evidence is out of a streaming head's reach.


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_evidence_is_outside_every_window_and_after_the_sink(layout):
    seq_len, window, sink, seed = layout
    b = batch(*layout)
    reach = window + tasks.default_margin(window)
    for i in range(b["tokens"].shape[0]):
        spec = tasks.TASKS[int(b["task_ids"][i])]
        needles = [j for j in b["needle_pos"][i].tolist() if j >= 0]
        if spec.category == "robust":
            assert not needles
            continue
        assert needles and all(j >= sink and j >= tasks.PREFIX_LEN for j in needles)
        pos = prediction_positions(b["targets"][i])
        for t in pos:
            assert all(t - j >= reach for j in needles), (spec.name, t, needles)
            assert not streaming_row(t, seq_len, sink, window)[needles].any()
        # The needles really are the evidence: every answer token is written at a needle position.
        answers = set(b["tokens"][i, torch.tensor(pos) + 1].tolist())
        assert answers <= set(b["tokens"][i, needles].tolist())


def test_passkey_depth_sweeps_from_the_sink_to_the_window_edge():
    seq_len, window, sink = 300, 32, 4
    reach = window + tasks.default_margin(window)
    starts = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        b = tasks.make_batch(["passkey"], 2, seq_len, window, sink, seed=0, depth=depth)
        starts.append(int(b["needle_pos"][0, 0]))
        last_needle = int(b["needle_pos"][0, tasks.PASSKEY_LEN])
        if depth == 1.0:
            assert int(b["query_pos"][0]) - last_needle == reach  # as close as allowed, no closer
    assert starts[0] == tasks.first_free(sink) and starts == sorted(starts) and len(set(starts)) == 5

# -----------------------------------------------------------------------------
# Oracles: one induction rule, two visibilities.


def induction_oracle(tokens, t, visible):
    """Predict token t + 1 from the keys in `visible` only, as an idealised induction head would:
    find the latest visible j < t - 1 whose token is the trigger (the current token; at a query
    marker or SEP, the token that opened the span to recall) and whose successor j + 1 is also
    visible, and copy tokens[j + 1]. Returns None when nothing visible matches."""
    cur = int(tokens[t])
    trigger = {tasks.get_task("passkey").marker: tasks.NEEDLE, tasks.SEP: tasks.get_task("local_copy").marker}.get(cur, cur)
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
        name = tasks.TASKS[int(b["task_ids"][i])].name
        for t in prediction_positions(b["targets"][i]):
            visible = streaming_row(t, S, sink, window) if streaming_only else causal_row(t, S)
            guess = induction_oracle(b["tokens"][i], t, visible)
            correct[name] = correct.get(name, 0) + ((tasks.VALUES.start if guess is None else guess)
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
    assert all(local[n] == 1.0 for n in tasks.ROBUST), local


@pytest.mark.parametrize("seq_len, window, sink", [(256, 32, 4), (200, 16, 0), (700, 128, 32)])
def test_streaming_oracle_cannot_beat_chance_on_sensitive_tasks(seq_len, window, sink):
    b = tasks.make_batch(tasks.SENSITIVE, 120, seq_len, window, sink, seed=11)
    local, found = oracle_accuracy(b, window, sink, streaming_only=True)
    dense, _ = oracle_accuracy(b, window, sink, streaming_only=False)
    for name in tasks.SENSITIVE:
        assert dense[name] == 1.0
        assert found[name] == 0.0, "a streaming view must hold no copy of the evidence"
        # ~4 % margin: 360-480 answer tokens per task, so 3 standard errors of a 1/16 guess rate.
        assert local[name] <= tasks.get_task(name).chance + 0.04, (name, local[name])

# -----------------------------------------------------------------------------
# Scoring helpers.


def test_token_accuracy_counts_argmax_hits_over_answer_tokens_only():
    targets = torch.full((2, 5), tasks.IGNORE)
    targets[0, 1], targets[0, 3] = 7, 9
    targets[1, 0] = 4
    logits = torch.zeros(2, 5, tasks.VOCAB_SIZE)
    logits[0, 1, 7] = 1.0   # right
    logits[0, 3, 8] = 1.0   # wrong
    logits[1, 0, 4] = 1.0   # right
    logits[:, 2, 5] = 9.0   # a non-answer position, ignored whatever it predicts
    acc = tasks.token_accuracy(logits, targets)
    assert acc.tolist() == [0.5, 1.0]


def test_perfect_logits_score_one_on_a_real_batch():
    b = tasks.make_batch(None, 10, 200, 32, 4, seed=0)
    safe = b["targets"].clamp(min=0)
    logits = torch.nn.functional.one_hot(safe, tasks.VOCAB_SIZE).float()  # (B, S, V)
    assert (tasks.token_accuracy(logits, b["targets"]) == 1.0).all()

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
    (dict(seed=1.5), "seed must be an int, got 1.5"),          # not quietly seed 1
    (dict(margin=-20), "margin must be >= 0, got -20"),        # evidence a streaming head could see
])
def test_bad_input_is_refused(kwargs, message):
    args = dict(tasks=None, batch_size=4, seq_len=256, window=32, sink=4, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tasks.make_batch(**args)
    with pytest.raises(ValueError, match="n_layers must be an int >= 1, got 0"):
        tasks.relay_margin(0, 32)
