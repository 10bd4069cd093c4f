"""A sweep: a grid of settings on one workload, each setting run `repeat` times with the settings interleaved
(A B A B), its runs tagged sweep:ID. Its full specification is stored (table sweeps) before its first run, so
the Sweeps page and `python -m engine sweep` make the same stored sweep, and the command that makes it again
is written from what is stored."""
from __future__ import annotations

import itertools
import json
import shlex
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone

from engine.errors import UserError
from engine.paths import workloads
from engine.spec import LIMITS, GenConfig, RunSpec
from engine.switches import names

SWEEP_TAG = "sweep:"
MAX_REPEAT = 10  # each setting's runs; the sweep takes this many times longer
MIN_TOKENS, MAX_TOKENS = 4, 512  # new tokens per run
KV = ("on", "off")
# A sweep's sparsity settings by name: (target sparsity, mode). Sparsity applies to fp32 weights only.
SPARSITY = {"dense": (0.0, "mask"), "mask-50": (0.5, "mask"), "skip-50": (0.5, "skip")}


class SweepError(UserError):
    """A sweep that cannot run as asked; the message is one sentence."""


def sweep_tag(sweep_id: str) -> str:
    """The tag a sweep's runs are stored with."""
    return SWEEP_TAG + sweep_id


def speculative_methods() -> dict[str, dict]:
    """The speculative methods a sweep can set, by name, with the GenConfig settings it runs each with."""
    from engine.switches.speculative import METHODS

    return {name: dict(speculative=name, **m.sweep) if name != "none" else {} for name, m in METHODS.items()}


@dataclass(frozen=True)
class Arm:
    """One setting of the grid."""
    weights: str
    kv: str
    sparsity: str
    speculative: str
    users: int = 1

    @property
    def label(self) -> str:
        return (f"{self.weights}, KV {self.kv}" + ("" if self.sparsity == "dense" else f", {self.sparsity}")
                + ("" if self.speculative == "none" else f", {self.speculative}")
                + ("" if self.users == 1 else f", {self.users} users"))

    @property
    def batchable(self) -> bool:
        """Whether several users can decode in one batch with these settings (engine.spec.check_batchable)."""
        return self.kv == "on" and self.sparsity == "dense" and self.speculative == "none"


@dataclass(frozen=True)
class SweepSpec:
    """Everything that decides what a sweep runs; the first value of each list is the baseline."""
    workload: str
    weights: list[str] = field(default_factory=lambda: ["fp32"])
    kv: list[str] = field(default_factory=lambda: ["on"])
    sparsity: list[str] = field(default_factory=lambda: ["dense"])
    speculative: list[str] = field(default_factory=lambda: ["none"])
    users: list[int] = field(default_factory=lambda: [1])  # sequences decoded together in one batch
    new_tokens: int = 32
    repeat: int = 3
    model: str = "default"
    device: str = "auto"

    def check(self) -> None:
        """Raise SweepError with one sentence for anything the sweep cannot run: its settings, then which weight
        levels the device runs."""
        self.check_settings()
        from engine.model.loader import pick_device
        from engine.switches.quant import available_levels

        runnable = available_levels(pick_device(self.device))
        slow = [lv for lv in self.weights if lv not in runnable]
        if slow:
            raise SweepError(f"The weight level '{slow[0]}' does not run on this device: choose from "
                             f"{', '.join(runnable)}.")

    def check_settings(self) -> None:
        """The names and numbers of the settings, with nothing heavy imported."""
        shipped = workloads()
        if self.workload not in shipped:
            raise SweepError(f"Unknown workload '{self.workload}': choose one of {', '.join(shipped)}.")
        for name, values, known in (("weight level", self.weights, list(names.LEVELS)),
                                    ("KV cache setting", self.kv, KV), ("sparsity", self.sparsity, list(SPARSITY)),
                                    ("speculative method", self.speculative, list(names.METHOD_HELP))):
            unknown = [v for v in values if v not in known]
            if unknown:
                raise SweepError(f"Unknown {name} '{unknown[0]}': choose from {', '.join(known)}.")
        for users in self.users:
            if not _whole(users, 1, int(LIMITS["users"].high)):
                raise SweepError(f"A sweep's batch holds 1 to {LIMITS['users'].high:.0f} users, not {users!r}.")
        if not _whole(self.repeat, 1, MAX_REPEAT):
            raise SweepError(f"A sweep repeats each setting 1 to {MAX_REPEAT} times, not {self.repeat!r}.")
        if not _whole(self.new_tokens, MIN_TOKENS, MAX_TOKENS):
            raise SweepError(f"A sweep's runs make {MIN_TOKENS} to {MAX_TOKENS} new tokens, not {self.new_tokens!r}.")
        if not self.grid():
            raise SweepError("The grid is empty: give at least one value of every setting (sparsity other than "
                             "dense needs fp32 weights; more than one user needs the KV cache on, dense and no "
                             "speculative method).")

    def grid(self) -> list[Arm]:
        """Every combination of the settings, in the order given; sparsity only with fp32 weights, a batch of
        several users only where its settings batch."""
        arms = [Arm(*combo) for combo in itertools.product(*(dict.fromkeys(getattr(self, name)) for name in
                                                              ("weights", "kv", "sparsity", "speculative", "users")))]
        return [arm for arm in arms if (arm.sparsity == "dense" or arm.weights == "fp32")
                and (arm.users == 1 or arm.batchable)]

    def run_spec(self, arm: Arm, sweep_id: str) -> RunSpec:
        """The run of one arm, tagged with the sweep."""
        cfg = GenConfig(workloads()[self.workload]["prompt"], max_new_tokens=self.new_tokens,
                        kv_cache=arm.kv == "on", ignore_eos=True, **speculative_methods()[arm.speculative])
        level, mode = SPARSITY[arm.sparsity]
        return RunSpec(gen=cfg, model=self.model, device=self.device, weights=arm.weights, sparsity=level,
                       sparsity_mode=mode, tag=sweep_tag(sweep_id), users=arm.users)

    def runs(self, sweep_id: str) -> list[tuple[Arm, RunSpec]]:
        """Every run of the sweep in the order to run them: the arms interleaved, `repeat` times."""
        from engine.measure.compare import interleaved  # scipy: not for the command line's parser

        return [(arm, self.run_spec(arm, sweep_id)) for arm in interleaved(self.grid(), self.repeat)]

    def arguments(self) -> list[str]:
        """`sweep`'s arguments for this specification (without --db)."""
        args = ["--workload", self.workload]
        for name in ("weights", "kv", "sparsity", "speculative", "users"):
            args += [f"--{name}", ",".join(map(str, getattr(self, name)))]
        args += ["--new-tokens", str(self.new_tokens), "--repeat", str(self.repeat)]
        for name in ("model", "device"):
            if getattr(self, name) != _default(name):
                args += [f"--{name}", getattr(self, name)]
        return args

    def command(self, db: str | None = None) -> str:
        """The shell command that makes this sweep again, copyable as it is."""
        return shlex.join(["python", "-m", "engine", "sweep", *self.arguments(), *(["--db", str(db)] if db else [])])

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SweepSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


def _default(name: str):
    return next(f.default for f in fields(SweepSpec) if f.name == name)


def _whole(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def start(store, spec: SweepSpec) -> str:
    """Check the sweep, store its specification under a new id (the time it starts, made unique), and return
    the id; bad input raises SweepError before anything is stored."""
    from engine.store.sql import utcnow  # pandas: not for the command line's parser either

    spec.check()
    base = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    taken = set(store.query("SELECT sweep_id FROM sweeps WHERE sweep_id LIKE ?", [base + "%"])["sweep_id"])
    sweep_id = next(c for c in itertools.chain([base], (f"{base}-{n}" for n in itertools.count(2))) if c not in taken)
    store.insert({"sweeps": [{"sweep_id": sweep_id, "created_at": utcnow(), "spec": spec.to_json()}]})
    return sweep_id


def stored(store, sweep_id: str) -> SweepSpec:
    """The specification a stored sweep was made with."""
    frame = store.query("SELECT spec FROM sweeps WHERE sweep_id = ?", [sweep_id])
    if frame.empty:
        raise SweepError(f"No sweep '{sweep_id}' in {store.path.name}: the Sweeps page lists the stored ones.")
    return SweepSpec.from_json(frame.iloc[0, 0])


def stored_ids(store) -> list[str]:
    """The stored sweeps' ids, newest first."""
    return list(store.query("SELECT sweep_id FROM sweeps ORDER BY created_at DESC, sweep_id DESC")["sweep_id"])


def arm_of(run: dict) -> Arm:
    """The arm a stored run of a sweep belongs to: its RunSpec's settings, and for a sequence of a batch the
    batch it was decoded in (its engine's max_batch, which a batched run is given its users as)."""
    from engine.run.reproduce import spec_of

    spec = spec_of(run)
    config = run["config"] if isinstance(run["config"], dict) else json.loads(run["config"] or "{}")
    sparsity = next((name for name, (level, mode) in SPARSITY.items()
                     if level == spec.sparsity and (mode == spec.sparsity_mode or not level)), f"{spec.sparsity:g}")
    return Arm(spec.weights, "on" if spec.gen.kv_cache else "off", sparsity, spec.gen.speculative,
               int(config.get("max_batch") or spec.users))
