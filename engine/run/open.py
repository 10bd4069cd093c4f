"""One way to start a run, local or served: open_run(spec, store) checks the spec and returns the run.

Both kinds are iterated the same way (events with .piece, .index, .t_ms, .gap_ms, .buckets) and hold
the same things afterwards: status, text, token_ids, steps, tokens, result, run_id, special_ids."""
from __future__ import annotations

from engine.run.generate import Generation
from engine.run.prepare import prepare
from engine.run.spec import RunSpec
from engine.serve.client import ServedRun
from engine.store.db import Store


def open_run(spec: RunSpec, store: Store | None = None, *, calibration: dict | None = None,
             telemetry: bool = True) -> Generation | ServedRun:
    """The run a spec describes, ready to iterate: the local engine with the model prepared, or a
    stream from the spec's server. A bad spec raises a UserError before anything is loaded or sent."""
    spec.check()
    if spec.backend == "served":
        return ServedRun(spec, store)
    return Generation(prepare(spec, store), spec.gen, store=store, calibration=calibration, telemetry=telemetry,
                      tag=spec.tag, spec=spec)
