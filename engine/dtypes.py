"""Number formats by name: bits per value for the calculators, torch dtypes for the engine.

The names are the ones every switch, page and command uses; torch is imported only when a torch
dtype is asked for, so the calculators stay pure."""

BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
# 4-bit floats with their block scales counted in: NVFP4 an 8-bit scale per 16 values, MXFP4 per 32
FP4_BITS = {"nvfp4": 4 + 8 / 16, "mxfp4": 4 + 8 / 32}
FLOATS = ("fp32", "bf16", "fp16")  # the formats torch computes in
KV_CHOICES = ("auto",) + FLOATS  # KV-cache precision: auto keeps the weights' compute dtype
# the local engine's weight levels whose products multiply integers: activations quantized to int8 as they run
INTEGER_LEVELS = ("int8-dyn", "int4-dyn")


def weight_level(weights: str) -> str:
    """The level's name in a model's weights label ("int4-wo g32" -> "int4-wo")."""
    return weights.split(" ")[0]


def torch_dtype(name: str):
    """The torch dtype of a float format name (fp32, bf16, fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def name_of(dtype) -> str:
    """The format name of a torch float dtype."""
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(dtype)]
