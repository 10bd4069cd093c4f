"""Prefill/decode disaggregation: the KV transfer is bytes over the link, TTFT pays it, TPOT sheds the prompts."""
import json
from dataclasses import replace

import pytest

from engine.cli.main import main
from engine.plan import disaggregate as dis
from engine.plan import kvcalc
from engine.plan import planner as plan
from engine.plan import simulate as sim

PROMPT, NEW = 4096, 64
SETUP = plan.Setup(model=plan.resolve_model("llama-3.1-8b"), gpu=plan.get_gpu("h100-80gb-sxm"), prompt_tokens=PROMPT,
                   new_tokens=NEW, efficiency=plan.Efficiency(link=1.0))
WORKLOAD = sim.Workload(requests=120, rate=6.0, prompt_tokens=PROMPT, new_tokens=NEW)


@pytest.mark.parametrize("link,gpus", [("nvlink", 1), ("infiniband", 1), ("nvlink", 2), ("ethernet", 4)])
def test_the_kv_transfer_is_each_gpus_share_of_the_cache_over_its_link(link, gpus):
    setup = replace(SETUP, gpus=gpus)
    sent = dis.kv_transfer_ms(setup, PROMPT, link)
    per_gpu = kvcalc.kv_bytes(setup.model.spec, PROMPT, "bf16", 1, gpus)
    gbps = {"nvlink": setup.gpu["gpu_link"]["gbps_per_direction"]}.get(link) or plan.interconnects()[link][
        "gbps_per_direction"]
    assert sent["bytes_per_gpu"] == per_gpu and sent["bytes"] == pytest.approx(per_gpu * gpus)
    hop_ms = plan.interconnects()[link]["hop_latency_us"] / 1e3
    assert sent["ms"] - hop_ms == pytest.approx(per_gpu / (gbps * 1e9) * 1e3)


def test_ttft_rises_by_the_transfer_and_tpot_falls_off_the_shared_gpus():
    near = dis.disaggregate(SETUP, WORKLOAD, sim.Scheduler(), 1, 1, "nvlink")
    far = dis.disaggregate(SETUP, WORKLOAD, sim.Scheduler(), 1, 1, "ethernet")
    prefill_only = sim.simulate(SETUP, replace(WORKLOAD, new_tokens=1), sim.Scheduler())["summary"]
    for r in (near, far):
        assert r["disaggregated"]["ttft_ms_p50"] == pytest.approx(prefill_only["ttft_ms_p50"] + r["kv_transfer_ms"])
    assert far["disaggregated"]["ttft_ms_p50"] - near["disaggregated"]["ttft_ms_p50"] == pytest.approx(
        far["kv_transfer_ms"] - near["kv_transfer_ms"])
    assert far["kv_transfer_ms"] > 10 * near["kv_transfer_ms"]
    # co-located, every decode step also carries chunks of 4,096-token prompts; in the decode pool none
    assert near["disaggregated"]["tpot_ms_p50"] < near["colocated"]["tpot_ms_p50"]
    assert near["colocated"] == far["colocated"]  # the co-located GPUs send nothing


def test_a_prefilled_request_decodes_from_its_cache_one_step_per_token():
    alone = sim.simulate(SETUP, sim.Workload(requests=1, rate=1.0, prompt_tokens=100, new_tokens=5, prefilled=True))
    row = alone["requests"][0]
    steps = [plan.forward_buckets(SETUP, plan.batch_work(SETUP.model.spec, [1], [100 + i])) for i in range(4)]
    step_ms = [sum(step[b] for b in plan.BUCKETS) for step in steps]
    assert row["ttft_ms"] == 0
    assert row["tpot_ms"] == pytest.approx(sum(step_ms) / 4)
    with pytest.raises(plan.PlanError, match="at least 2 output tokens"):
        sim.simulate(SETUP, sim.Workload(requests=1, rate=1.0, new_tokens=1, prefilled=True))


CLI = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb-sxm", "--prompt-tokens", "2048", "--new-tokens", "32",
       "--requests", "20"]


def test_the_command_line_compares_the_pools_in_json(capsys):
    assert main([*CLI, "--rate", "4", "--disaggregate", "1:2", "--link", "infiniband", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["prefill_gpus"], out["decode_gpus"], out["link"]) == (1, 2, "infiniband")
    assert out["colocated"]["instances"] == 3 and out["disaggregated"]["decode_instances"] == 2
    for pool in ("colocated", "disaggregated"):
        assert {"ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"} <= set(out[pool])
    assert out["kv_transfer_ms"] == pytest.approx(dis.kv_transfer_ms(
        replace(SETUP, efficiency=plan.Efficiency()), 2048, "infiniband")["ms"])


@pytest.mark.parametrize("args,words", [
    (["--rate", "4", "--disaggregate", "2x2"], "PREFILL_GPUS:DECODE_GPUS"),
    (["--rate", "4", "--disaggregate", "0:2"], "at least one GPU"),
    (["--disaggregate", "1:1"], "--rate"),
    (["--rate", "4", "--disaggregate", "1:1", "--offline"], "not with --offline"),
    (["--rate", "4", "--disaggregate", "4:8", "--link", "nvlink"], "joins at most 8 GPUs"),
    (["--rate", "4", "--disaggregate", "3:2", "--gpus", "2"], "multiple of it"),
    (["--rate", "4", "--disaggregate", "1:1", "--link", "pigeon"], "Unknown link"),
])
def test_bad_disaggregation_input_is_one_sentence_and_exit_2(args, words, capsys):
    assert main([*CLI, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
