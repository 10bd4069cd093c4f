"""The rows a run records, typed: one StepRow per forward, one TokenRow per emitted token.

account() turns a finished step's timing marks and work into them; it is pure, so the decode loop
stays a coordinator and tests can check the sums. The store's steps and tokens tables have exactly
these columns (plus run_id)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.measure.accounting import ForwardWork, ModelShape, forward_work, reduce_work
from engine.measure.distances import BUCKETS, PHASES, Roofline, attribute, split_over_tokens, waste_fraction
from engine.switches.sparsity import forward_savings


@dataclass
class BucketRow:
    """The five buckets of a row, in ms."""
    physical_ms: float
    memory_ms: float
    compute_ms: float
    time_ms: float
    decision_ms: float


@dataclass
class StepRow(BucketRow):
    step: int
    kind: str  # prefill or decode
    n_input: int
    n_emitted: int
    drafted: int
    accepted: int
    context_len: int
    draft_ms: float
    upload_ms: float
    forward_ms: float
    sync_ms: float
    select_ms: float
    host_ms: float
    wall_ms: float
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: float
    memory_est_ms: float
    compute_est_ms: float
    roofline_ms: float
    waste_fraction: float
    batch: int = 1  # sequences whose tokens this forward computed together (the weights read once for all)


@dataclass
class TokenRow(BucketRow):
    idx: int
    step: int
    token_id: int
    piece: str
    t_ms: float  # since the request started, when the token was handed over
    gap_ms: float  # the step's wall time for its first token, 0 for the others it emitted


@dataclass
class ServedStepRow(BucketRow):
    """One streamed chunk of a served run. memory and compute are None when the server's work is not
    split (no GPU named); server_work_ms then holds their sum."""
    step: int
    kind: str  # prefill (the first chunk) or decode
    n_emitted: int
    context_len: int
    wall_ms: float
    server_work_ms: float


@dataclass
class ServedTokenRow(TokenRow):
    """One token of a served run: the server's id, the tokenizer's (retokenised), or None when neither is known."""
    server_work_ms: float
    retokenised: bool


def columns(row: BucketRow) -> dict:
    """A row's columns by name. Its fields are plain numbers and strings, so this is a copy of its
    attributes: dataclasses.asdict walks and deep-copies each value, which costs a decode step
    about a tenth of a millisecond."""
    return dict(vars(row))


@dataclass
class Outcome:
    """What one step did: its inputs, its guesses, what it emitted, and when each phase began
    (perf_counter_ns: start, draft, upload, forward, sync, select, host)."""
    n_input: int
    past: int  # positions already in the KV cache before the step
    drafted: int
    accepted: int
    emitted: list[int]
    marks: tuple
    kv_bytes: tuple[int, int] | None = None  # (read, written) of the KV cache, where the forward counted them
    batch: int = 1  # sequences sharing the forward; this one's rows take 1/batch of the weights it read


@dataclass(frozen=True)
class Attribution:
    """What the accounting needs to know about the model and the device."""
    shape: ModelShape
    roofline: Roofline
    kv_cache: bool
    sparse: tuple = ()  # the model's sparse layers, whose counts say what each forward skipped


def phases_ms(marks: tuple, t_end: int) -> dict:
    start, t_draft, t_upload, t_forward, t_sync, t_select, t_host = marks
    ms = lambda a, b: (b - a) / 1e6  # noqa: E731
    return {
        "draft": ms(t_draft, t_upload), "upload": ms(t_upload, t_forward), "forward": ms(t_forward, t_sync),
        "sync": ms(t_sync, t_select), "select": ms(t_select, t_host),
        # bookkeeping after the tokens, plus the time since the previous step handed over its tokens
        "host": ms(t_host, t_end) + ms(start, t_draft),
    }


def step_work(a: Attribution, out: Outcome, first_step: bool) -> tuple[ForwardWork, ForwardWork | None]:
    """(work the forward did, the part of it whose results were used; None when all were)."""
    work = forward_work(a.shape, out.n_input, out.past, kv_cache=a.kv_cache, logits_kept=out.drafted + 1,
                        kv_bytes=out.kv_bytes)
    if out.batch > 1:  # the weights travelled once for every sequence in the batch: this one's share
        work = replace(work, weight_bytes=work.weight_bytes // out.batch)
    kept = 1 + out.accepted  # positions whose results are used: the pending token and the accepted drafts
    if not a.kv_cache and not first_step:  # a cached decoder would only have run the kept positions
        useful = forward_work(a.shape, kept, out.n_input - out.drafted - 1, logits_kept=kept)
    elif out.drafted:
        useful = forward_work(a.shape, out.n_input - out.drafted + out.accepted, out.past, logits_kept=kept)
    else:
        useful = None
    if a.sparse:
        saved = forward_savings(list(a.sparse))  # this forward's skipped and masked rows; resets the counts
        work = reduce_work(work, saved["skipped_bytes"], saved["skipped_flops"])
        if saved["zero_bytes"] or saved["zero_flops"]:  # masked: zeros multiplied for nothing
            useful = reduce_work(useful or work, saved["zero_bytes"], saved["zero_flops"])
    return work, useful


def account(a: Attribution, step: int, out: Outcome, emitted: list[tuple[int, str]], first_idx: int,
            t_request: int, t_end: int) -> tuple[StepRow, list[TokenRow]]:
    """The step's row and its tokens' rows: the wall time from the step's start to t_end split into
    phases, then into the five buckets, divided evenly over the tokens it emitted."""
    phases = phases_ms(out.marks, t_end)
    work, useful = step_work(a, out, first_step=step == 0)
    draft_waste = (out.drafted - out.accepted) / out.drafted if out.drafted else 0.0
    attributed = attribute(phases, work, a.roofline, waste_fraction(a.roofline, work, useful), draft_waste)
    buckets = attributed["buckets"]
    wall = (t_end - out.marks[0]) / 1e6
    row = StepRow(
        step=step, kind="prefill" if step == 0 else "decode", n_input=out.n_input, n_emitted=len(emitted),
        drafted=out.drafted, accepted=out.accepted, context_len=out.past + out.n_input,
        **{f"{p}_ms": phases[p] for p in PHASES}, wall_ms=wall,
        weight_bytes=work.weight_bytes, kv_read_bytes=work.kv_read_bytes, kv_write_bytes=work.kv_write_bytes,
        flops=work.flops, memory_est_ms=attributed["memory_est_ms"], compute_est_ms=attributed["compute_est_ms"],
        roofline_ms=attributed["roofline_ms"], waste_fraction=attributed["waste_fraction"], batch=out.batch,
        **{f"{b}_ms": buckets[b] for b in BUCKETS})
    per_token = split_over_tokens(buckets, max(len(emitted), 1))
    t_ms = (t_end - t_request) / 1e6
    tokens = [TokenRow(idx=first_idx + i, step=step, token_id=token, piece=piece, t_ms=t_ms,
                       gap_ms=wall if i == 0 else 0.0, **{f"{b}_ms": per_token[b] for b in BUCKETS})
              for i, (token, piece) in enumerate(emitted)]
    return row, tokens
