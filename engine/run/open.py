"""One way to start a run, local or served, alone or batched: open_run(spec, store) checks the spec and returns
the run.

Every kind is iterated the same way (events with .piece, .index, .t_ms, .gap_ms, .buckets; a batch's also
with .user and .run_id) and holds the same things afterwards: status, text, token_ids, steps, tokens,
result, run_id, special_ids (a batch: status, steps, tokens, result, run_id, run_ids, special_ids)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.run.generate import Generation
from engine.run.local import BatchRun
from engine.run.prepare import prepare
from engine.spec import RunSpec
from engine.store.db import Store

if TYPE_CHECKING:
    from engine.serve.client import ServedRun


def open_run(spec: RunSpec, store: Store | None = None, *, calibration: dict | None = None,
             telemetry: bool = True, prompts_file: str | None = None,
             kv_budget_bytes: int | None = None) -> Generation | ServedRun | BatchRun:
    """The run a spec describes, ready to iterate: the local engine with the model prepared (spec.users > 1:
    one batch of that many sequences, the others' prompts from prompts_file or the workloads, under a KV
    budget when one is given), or a stream from the spec's server. A bad spec raises a UserError before
    anything is loaded or sent; a batch's requests are all checked before any is recorded."""
    spec.check()
    if spec.backend == "served":
        from engine.serve.client import ServedRun  # a local run does without the OpenAI client's half second of imports

        return ServedRun(spec, store)
    if spec.users > 1:
        return BatchRun(prepare(spec, store), spec, store, calibration=calibration, prompts_file=prompts_file,
                        kv_budget_bytes=kv_budget_bytes)
    return Generation(prepare(spec, store), spec.gen, store=store, calibration=calibration, telemetry=telemetry,
                      tag=spec.tag, spec=spec)
