"""The Story's comparison picture: an arm of several users is drawn as its batch, the time per token of every
user together (the figure its speed ratio compares), not one user's time per token with its wait for the batch."""
import pytest

from engine.measure.distances import BUCKETS
from engine.report import story

MEMORY = story.BY_KEY["memory"]
BATCHING = MEMORY.comparisons[1]  # one user against eight in one batch


def stored(store, arm: str, time_ms: float, tokens: int = 6) -> int:
    """A finished run of the arm whose buckets are 2 ms of memory, 3 of compute and time_ms of time."""
    run_id = store.start_run(model="synthetic", device="cpu", dtype="float32", config={"weights": "fp32"},
                             hardware={}, prompt=story.SHORT_PROMPT, tag=story.tag(MEMORY, arm))
    distances = {b: 0.0 for b in BUCKETS} | {"memory": 2.0, "compute": 3.0, "time": time_ms}
    store.finish_run(run_id, status="ok", metrics={"decode_tokens_per_s": 10.0, "n_new_tokens": tokens,
                                                   "distances_ms": distances})
    return run_id


def test_a_batch_is_drawn_per_token_of_all_its_users_and_a_lone_run_as_it_is(store):
    single = stored(store, "fp32", 55.0)
    old_batch = [stored(store, "users-8", 1000.0) for _ in range(8)]
    # the newest batch: the later users waited longer for it to admit them, as on a busy machine
    batch = [stored(store, "users-8", 100.0 * user) for user in range(8)]
    runs = story.latest_runs(store, MEMORY)
    assert runs["users-8"]["run_id"] == batch[-1]

    name, bar = story.batch_bar(store, runs["users-8"], 8)
    assert name == f"#{batch[0]}-#{batch[-1]}, all 8 users" and old_batch[-1] < batch[0]
    assert bar["n_new_tokens"] == 48  # every user's tokens
    assert bar["time_ms"] == pytest.approx(sum(100.0 * user for user in range(8)) / 8)  # the users' mean
    assert bar["memory_ms"] == pytest.approx(2.0) and bar["compute_ms"] == pytest.approx(3.0)

    name, bar = story.batch_bar(store, runs["fp32"], 1)
    assert name == f"#{single}" and bar is runs["fp32"]

    rows = story.comparison_rows(store, BATCHING, runs)
    figure = story.picture(store, BATCHING, runs, rows)
    time_trace = next(trace for trace in figure.data if trace.name == "time")
    # ms per token: the lone run's 55 ms over its 6 tokens; the batch's mean wait over all 48 tokens
    assert list(time_trace.x) == pytest.approx([55.0 / 6, 350.0 / 48])
    assert "all 8 users" in figure.data[0].y[1]
    assert figure.layout.title.yanchor == "top"  # above a legend that wraps in a narrow window


def test_a_batch_with_runs_missing_is_drawn_as_its_newest_run(store):
    for _ in range(3):
        stored(store, "users-8", 40.0)
    run = story.latest_runs(store, MEMORY)["users-8"]
    assert story.batch_bar(store, run, 8) == (f"#{run['run_id']}", run)
