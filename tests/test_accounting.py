"""Bytes and FLOPs from real tensors; the five buckets always sum to the step's wall time."""
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.measure.accounting import ForwardWork, cache_nbytes, forward_work, model_shape
from engine.measure.distances import PHASES, Roofline, attribute, waste_fraction
from engine.run.generate import Generation, GenConfig


def test_weight_bytes_count_a_tied_embedding_once(tiny_lm):
    shape = model_shape(tiny_lm.model)
    unique = {t.data_ptr(): t.nbytes for t in [*tiny_lm.model.parameters(), *tiny_lm.model.buffers()]}
    assert shape.weight_bytes == sum(unique.values())
    assert shape.embed_row_bytes == 0
    work = forward_work(shape, n_new=5, past_len=0)
    assert work.weight_bytes == shape.weight_bytes


def test_an_untied_embedding_is_read_only_for_the_looked_up_rows():
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    shape = model_shape(model)
    embed = model.get_input_embeddings().weight
    everything = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert shape.weight_bytes == everything - embed.nbytes
    assert forward_work(shape, 3, 0).weight_bytes == shape.weight_bytes + 3 * embed[0].nbytes


def test_flops_match_a_hand_count(tiny_lm):
    c = tiny_lm.config  # 2 layers, hidden 64, 4 heads of 16, 2 kv heads, mlp 128, vocab V
    shape = model_shape(tiny_lm.model)
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)  # q, k+v, o, gate+up+down
    assert shape.body_linear_params == c.num_hidden_layers * per_layer
    work = forward_work(shape, n_new=1, past_len=9)
    attention = 4 * 2 * 4 * 16 * 10  # layers x heads x head_dim x 10 keys, QK^T and AV
    assert work.flops == 2 * shape.body_linear_params + 2 * 64 * c.vocab_size + attention


@pytest.mark.parametrize("max_new", [1, 7, 30])
def test_predicted_kv_bytes_equal_the_real_cache(tiny_lm, calibration, max_new):
    gen = Generation(tiny_lm, GenConfig("Some prompt text", raw=True, max_new_tokens=max_new),
                     calibration=calibration, telemetry=False)
    gen.run()
    context = len(gen.prompt_ids) + len(gen.token_ids) - 1  # the last token is never fed back
    assert cache_nbytes(gen.cache) == model_shape(tiny_lm.model).kv_bytes_per_token * context
    assert gen.cache.get_seq_length() == context


def test_kv_bytes_follow_the_cache_dtype(tiny_lm):
    fp32 = model_shape(tiny_lm.model)
    bf16 = model_shape(tiny_lm.model, kv_dtype=torch.bfloat16)
    assert fp32.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token


def random_phases(rng):
    return {p: rng.uniform(0, 50) if p == "forward" else rng.uniform(0, 0.5) for p in PHASES}


def test_buckets_are_non_negative_and_sum_to_the_wall_time():
    rng = random.Random(0)
    for _ in range(2000):
        phases = random_phases(rng)
        work = ForwardWork(weight_bytes=rng.randint(0, 10**9), kv_read_bytes=rng.randint(0, 10**8),
                           kv_write_bytes=rng.randint(0, 10**7), flops=rng.uniform(0, 1e11))
        roofline = Roofline(memory_gbps=rng.uniform(5, 3000), peak_gflops=rng.uniform(50, 1e6))
        out = attribute(phases, work, roofline, waste=rng.random())
        assert all(v >= 0 for v in out["buckets"].values())
        assert sum(out["buckets"].values()) == pytest.approx(sum(phases.values()), rel=1e-12, abs=1e-12)


def test_memory_bucket_is_capped_by_the_forward_time():
    roofline = Roofline(memory_gbps=1.0, peak_gflops=1.0)
    phases = dict.fromkeys(PHASES, 0.0) | {"forward": 2.0}
    out = attribute(phases, ForwardWork(10**9, 0, 0, 0.0), roofline)
    assert out["buckets"]["memory"] == 2.0 and out["buckets"]["time"] == 0.0
    assert out["memory_est_ms"] == 1000.0


def test_waste_is_the_roofline_share_of_thrown_away_work():
    roofline = Roofline(memory_gbps=1.0, peak_gflops=1.0)
    useful = ForwardWork(10**6, 0, 0, 0.0)
    assert waste_fraction(roofline, useful, useful) == 0.0
    assert waste_fraction(roofline, ForwardWork(4 * 10**6, 0, 0, 0.0), useful) == pytest.approx(0.75)
    assert waste_fraction(roofline, useful, None) == 0.0
