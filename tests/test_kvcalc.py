"""The KV calculator against hand-computed figures and against the engine's real cache."""
import json

import pytest
import torch

from engine.plan import kvcalc
from engine.measure.accounting import cache_nbytes
from engine.run.generate import Generation, GenConfig
from engine.plan.kvcalc import KVCalcError, calculate, kv_bytes, spec, spec_from_config


def test_the_seeds_example():
    s = spec(layers=96, kv_heads=96, head_dim=128)
    r = calculate(s, context=2048, dtype="fp16")
    assert r["values_per_token"] == 2_359_296  # about 2.36 M
    assert r["bytes_per_token"] == 4_718_592  # about 4.7 MB
    assert r["total_bytes"] == 9_663_676_416  # about 9.7 GB
    assert r["total_bytes"] / 2**30 == pytest.approx(9.0)  # 9.0 GiB
    assert kvcalc.human(r["total_bytes"]) == "9.66 GB (9.00 GiB)"


def test_fp4_kv_levels_count_their_block_scales():
    gqa = spec_from_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                            "hidden_size": 4096})
    values = 2 * 32 * 8 * 128 * 1024
    assert kv_bytes(gqa, 1024, "nvfp4") == pytest.approx(values * (4 + 8 / 16) / 8)  # an fp8 scale per 16 values
    assert kv_bytes(gqa, 1024, "mxfp4") == pytest.approx(values * (4 + 8 / 32) / 8)  # an 8-bit scale per 32


def test_gqa_and_mqa_use_kv_heads_not_attention_heads():
    gqa = spec_from_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                            "hidden_size": 4096})
    assert (gqa.kind, gqa.head_dim) == ("GQA", 128)
    assert kv_bytes(gqa, 1000, "bf16") == 2 * 32 * 8 * 128 * 2 * 1000
    mqa = spec_from_config({"n_layer": 32, "n_head": 71, "hidden_size": 4544, "multi_query": True})
    assert (mqa.kind, mqa.kv_heads, mqa.head_dim) == ("MQA", 1, 64)
    assert kv_bytes(mqa, 10, "fp16") == 2 * 32 * 1 * 64 * 2 * 10


def test_head_dim_from_config_wins_over_hidden_over_heads():
    s = spec_from_config({"num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
                          "head_dim": 256, "hidden_size": 3584})
    assert s.head_dim == 256


def test_mla_stores_one_latent_per_layer():
    s = spec_from_config({"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168,
                          "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    assert s.kind == "MLA"
    assert kvcalc.values_per_token(s) == 61 * 576
    assert kv_bytes(s, 4096, "bf16") == 61 * 576 * 4096 * 2
    assert kv_bytes(s, 4096, "bf16", tp=8) == kv_bytes(s, 4096, "bf16")  # the latent is replicated


def test_sliding_window_caps_the_windowed_layers():
    every = spec_from_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "hidden_size": 4096, "sliding_window": 4096})
    per_token = 2 * 32 * 8 * 128 * 2
    assert kv_bytes(every, 1000, "fp16") == per_token * 1000
    assert kv_bytes(every, 10000, "fp16") == per_token * 4096
    half = spec_from_config({"num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                             "head_dim": 8, "sliding_window": 10,
                             "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert kv_bytes(half, 100, "fp32") == 2 * 1 * 8 * 4 * (2 * 100 + 2 * 10)
    off = spec_from_config({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 16,
                            "sliding_window": 4, "use_sliding_window": False})
    assert off.window is None


def test_quantized_kv_counts_its_group_scales():
    s = spec(layers=1, kv_heads=1, head_dim=64)
    assert kv_bytes(s, 1, "int4", group=64) == 128 * (4 + 16 / 64) / 8
    assert kv_bytes(s, 1, "int8", group=32) == 128 * (8 + 16 / 32) / 8
    assert kv_bytes(s, 1, "fp8") == 128


def test_tensor_parallel_splits_kv_heads_and_replicates_when_too_few():
    s = spec(layers=2, kv_heads=8, head_dim=16, attention_heads=32)
    assert kv_bytes(s, 10, "fp16", tp=4) == kv_bytes(s, 10, "fp16") / 4
    assert kv_bytes(s, 10, "fp16", tp=16) == kv_bytes(s, 10, "fp16") / 8  # one head per GPU at least


def test_fit_longest_context_and_batch_against_a_gpu():
    s = spec(layers=2, kv_heads=1, head_dim=64, params=1e6)
    gpu = {"name": "toy", "memory_mib": 1, "bandwidth_gbps": 1}
    r = calculate(s, context=100, dtype="fp16", weight_dtype="fp16", gpus=[gpu])["gpus"][0]
    free = 2**20 - 2e6 / 1  # 1 MiB minus 2 MB of weights is negative: nothing fits
    assert free < 0 and not r["fits"] and r["longest_context"] == 0
    s = spec(layers=2, kv_heads=1, head_dim=64, params=1e5)
    r = calculate(s, context=100, dtype="fp16", weight_dtype="fp16", gpus=[gpu])["gpus"][0]
    per_token = 2 * 2 * 64 * 2
    free = 2**20 - 2e5
    assert r["fits"]
    assert r["longest_context"] == int(free // per_token)
    assert r["largest_batch"] == int(free // (per_token * 100))
    assert r["kv_read_ms_per_step"] == pytest.approx(per_token * 100 / 1e9 * 1e3)


@pytest.mark.parametrize("bad, message", [
    (dict(layers=0, kv_heads=1, head_dim=1), "layers"),
    (dict(layers=1, kv_heads=-2, head_dim=1), "kv_heads"),
    (dict(layers=1, kv_heads=4, head_dim=1, attention_heads=2), "exceed"),
])
def test_bad_shapes_get_one_sentence(bad, message):
    with pytest.raises(KVCalcError, match=message):
        spec(**bad)


def test_bad_sizes_and_configs_get_one_sentence(tmp_path):
    s = spec(layers=1, kv_heads=1, head_dim=1)
    with pytest.raises(KVCalcError, match="batch"):
        kv_bytes(s, 10, batch=0)
    with pytest.raises(KVCalcError, match="context"):
        kv_bytes(s, -1)
    with pytest.raises(KVCalcError, match="not a causal language model"):
        spec_from_config({"architectures": ["BertForMaskedLM"], "num_hidden_layers": 12,
                          "num_attention_heads": 12, "hidden_size": 768})
    with pytest.raises(KVCalcError, match="layer or attention-head count"):
        spec_from_config({"vocab_size": 10})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(KVCalcError, match="not valid JSON"):
        kvcalc.read_config_file(bad)


def test_every_shipped_preset_loads():
    presets = kvcalc.load_presets()
    kinds = {s.kind for s in presets.values()}
    assert {"MHA", "GQA", "MQA", "MLA"} <= kinds
    assert any(s.window for s in presets.values())
    assert all(s.params for s in presets.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calculator_equals_the_real_cache_of_a_live_model(tiny_lm, calibration, dtype):
    tiny_lm.model.to(dtype)
    try:
        s = kvcalc.spec_from_model_config(tiny_lm.config, tiny_lm.name)
        name = "fp32" if dtype == torch.float32 else "bf16"
        for new in (1, 5, 20):
            gen = Generation(tiny_lm, GenConfig("Some words to start", raw=True, max_new_tokens=new, ignore_eos=True),
                             calibration=calibration, telemetry=False)
            gen.run()
            context = len(gen.prompt_ids) + new - 1
            assert gen.cache.layers[0].keys.dtype == dtype
            assert cache_nbytes(gen.cache) == kv_bytes(s, context, name)
    finally:
        tiny_lm.model.to(torch.float32)


def test_cli_kvcalc_json(tmp_path):
    from engine.cli.main import main
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["kvcalc", "--layers", "96", "--kv-heads", "96", "--head-dim", "128", "--json"]) == 0
    out = json.loads(buf.getvalue())
    assert out["values_per_token"] == 2_359_296 and out["total_bytes"] == 9_663_676_416
    assert out["bytes_per_token"] == 4_718_592
    assert main(["kvcalc", "--preset", "no such model"]) == 2


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_calculator_equals_the_default_models_real_cache(default_lm, calibration, dtype):
    from engine.model.loader import load_model

    lm = default_lm if dtype == "fp32" else load_model(dtype=dtype)  # the session's fp32 model, not a second copy
    s = kvcalc.spec_from_model_folder("default")
    assert (s.layers, s.kv_heads, s.head_dim, s.kind) == (30, 3, 64, "GQA")
    assert s.params == sum(p.numel() for p in lm.model.parameters())
    for prompt, new in [("Hi", 1), ("Tell me about the sea. " * 20, 12)]:
        gen = Generation(lm, GenConfig(prompt, max_new_tokens=new, ignore_eos=True), calibration=calibration,
                         telemetry=False)
        gen.run()
        context = len(gen.prompt_ids) + new - 1
        assert cache_nbytes(gen.cache) == kv_bytes(s, context, dtype)


def _config(tmp_path, **fields) -> str:
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_size": 4096}
    config.update(fields)
    path = tmp_path / "config.json"
    # json.dumps writes NaN and Infinity for float("nan") and float("inf"), as some exporters do
    path.write_text(json.dumps(config))
    return str(path)


BAD_KVCALC = {
    "tp 0": lambda p: ["--preset", "llama-2-7b", "--tp", "0"],
    "context 10**400": lambda p: ["--preset", "llama-2-7b", "--context", "1" + "0" * 400],
    "batch 10**400": lambda p: ["--preset", "llama-2-7b", "--batch", "1" + "0" * 400],
    "params 1e400": lambda p: ["--preset", "llama-2-7b", "--params", "1e400"],
    "params nan": lambda p: ["--preset", "llama-2-7b", "--params", "nan"],
    "params -3": lambda p: ["--preset", "llama-2-7b", "--params", "-3"],
    "config is a folder": lambda p: ["--config", str(p)],
    "config missing": lambda p: ["--config", str(p / "nope.json")],
    "layers a string": lambda p: ["--config", _config(p, num_hidden_layers="32")],
    "layers a list": lambda p: ["--config", _config(p, num_hidden_layers=[32])],
    "layers NaN": lambda p: ["--config", _config(p, num_hidden_layers=float("nan"))],
    "heads Infinity": lambda p: ["--config", _config(p, num_attention_heads=float("inf"))],
    "layers 2.7": lambda p: ["--config", _config(p, num_hidden_layers=2.7)],
    "layers true": lambda p: ["--config", _config(p, num_hidden_layers=True)],
    "layers 10**400": lambda p: ["--config", _config(p, num_hidden_layers=10**400)],
    "kv heads not dividing": lambda p: ["--config", _config(p, num_key_value_heads=5)],
    "sliding window a string": lambda p: ["--config", _config(p, sliding_window="4096")],
    "layer_types not a list": lambda p: ["--config", _config(p, sliding_window=8, layer_types="sliding_attention")],
    "architectures a string": lambda p: ["--config", _config(p, architectures="LlamaForCausalLM")],
    "window 128 sliding 1000": lambda p: ["--preset", "llama-2-7b", "--window", "128", "--sliding-layers", "1000"],
    "window 128 sliding -5": lambda p: ["--preset", "llama-2-7b", "--window", "128", "--sliding-layers", "-5"],
    "sliding -5 alone": lambda p: ["--preset", "llama-2-7b", "--sliding-layers", "-5"],
    "window -3": lambda p: ["--preset", "llama-2-7b", "--window", "-3"],
    "group 0": lambda p: ["--preset", "llama-2-7b", "--dtype", "int4", "--group", "0"],
    "layers 0": lambda p: ["--layers", "0", "--kv-heads", "1", "--head-dim", "8"],
}


@pytest.mark.parametrize("case", list(BAD_KVCALC))
def test_bad_kvcalc_input_exits_2_with_one_sentence(case, tmp_path, capsys):
    from engine.cli.main import main

    assert main(["kvcalc", *BAD_KVCALC[case](tmp_path)]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("."), out.err
    assert "Traceback" not in out.err and out.out == ""


def test_a_model_folder_given_as_config_reads_its_config_json(capsys):
    from engine.cli.main import main

    assert main(["kvcalc", "--config", str(kvcalc.DATA / "models" / "SmolLM2-135M-Instruct"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 30


def test_preset_ids_are_accepted_and_every_id_resolves(capsys):
    from engine.cli.main import main
    from engine.plan.planner import preset_ids

    for pid, name in preset_ids().items():
        assert main(["kvcalc", "--preset", pid, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == name


GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 34, "num_attention_heads": 8,
                             "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2560, "sliding_window": 1024,
                             "sliding_window_pattern": 6, "max_position_embeddings": 131072}}
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "cache_implementation": "hybrid",
             "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "hidden_size": 3584, "sliding_window": 4096, "max_position_embeddings": 8192}


def test_gemma3_without_layer_types_has_every_sixth_layer_full():
    s = spec_from_config(GEMMA3_4B)
    assert (s.layers, s.sliding_layers, s.window) == (34, 29, 1024)
    # 5 full layers x 131072 tokens + 29 sliding layers x 1024, each 2 x 4 heads x 256 values of 2 bytes
    assert kv_bytes(s, 131072, "bf16") == (5 * 131072 + 29 * 1024) * 2 * 4 * 256 * 2
    assert 2.7e9 < kv_bytes(s, 131072, "bf16") < 2.9e9
    no_pattern = {**GEMMA3_4B, "text_config": {k: v for k, v in GEMMA3_4B["text_config"].items()
                                               if k != "sliding_window_pattern"}}
    assert spec_from_config(no_pattern).sliding_layers == 29  # Gemma-3's own default


def test_gemma2_with_a_hybrid_cache_alternates_sliding_and_full_layers():
    s = spec_from_config(GEMMA2_9B)
    assert (s.sliding_layers, s.window) == (21, 4096)
    listed = {**GEMMA2_9B, "layer_types": ["sliding_attention", "full_attention"] * 21}
    assert kv_bytes(s, 8192, "bf16") == kv_bytes(spec_from_config(listed), 8192, "bf16")
    for config in ({**GEMMA2_9B, "model_type": "other"}, {k: v for k, v in GEMMA2_9B.items() if k != "model_type"}):
        assert spec_from_config(config).sliding_layers == 21  # the hybrid cache alone says so


def test_a_sliding_window_alone_still_applies_to_every_layer():
    mistral = {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096}
    assert spec_from_config(mistral).sliding_layers == 32
