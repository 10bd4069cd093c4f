"""The switches' names without their machinery: what the command line offers and refuses before it
imports torch. The registries (engine.switches.quant.LEVELS, engine.switches.speculative.METHODS)
register the same names in the same order, the speculative methods with the help written here (and
GenConfig.check refuses a run with these facts, so a refused command never loads the machinery)."""

LEVELS = ("fp32", "bf16", "fp16", "int8-wo", "int8-dyn", "int4-wo", "int4-dyn")  # the weight levels shipped
INT4_GROUPS = (32, 64, 128, 256)
MODES = ("mask", "skip")  # activation sparsity; "2:4" (weights, CUDA only) lives in engine.switches.sparse24
ALL_MODES = (*MODES, "2:4")  # every mode a run may name, as the command line and the Live page offer them

METHOD_HELP = {
    "none": "plain decoding: one target forward per token",
    "prompt-lookup": "drafts the continuation of the latest earlier match of the last n tokens; no second model",
    "draft": "a smaller draft model (self-int8, self-exit:K, or a model sharing the tokenizer) guesses K tokens",
    "lookahead": "lookahead decoding: Jacobi trajectories collect n-grams that are verified in the same forward",
    "jacobi": "the target's own predictions from the last verification are the next guesses",
}  # the speculative methods shipped
SAMPLING_METHODS = ("draft",)  # the methods that also run with temperature > 0 (speculative sampling)
MAX_K = 16  # the most tokens drafted per step
