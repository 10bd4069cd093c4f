"""Tokenpath's engine: models, the instrumented decode loop, attribution, the store.

OpenMP's threads, by default, spin after each parallel region; a decode step runs a hundred small
regions, and on a machine whose cores other work shares the spinning threads take the cores the
next region needs. Waiting passively (read once, when PyTorch loads OpenMP: before `import torch`)
costs a wake-up per region instead. An OMP_WAIT_POLICY set by the user is kept."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
