"""SLO strings, a request's metrics and goodput as vLLM bench serve defines them."""
import math

import pytest

from engine.errors import UserError
from engine.measure import slo


def test_an_slo_string_parses_into_targets_in_ms():
    assert slo.parse_slo("ttft_ms=500, tpot_ms=50,e2e_ms=1e4") == {"ttft_ms": 500.0, "tpot_ms": 50.0, "e2e_ms": 1e4}


@pytest.mark.parametrize("text", ["", "ttft_ms", "ttft=500", "ttft_ms=abc", "ttft_ms=0", "ttft_ms=-3",
                                  "ttft_ms=nan", "ttft_ms=inf", "ttft_ms=1,ttft_ms=2"])
def test_a_bad_slo_string_is_one_user_error(text):
    with pytest.raises(UserError) as e:
        slo.parse_slo(text)
    assert str(e.value).count(".") >= 1 and "\n" not in str(e.value)


def test_request_metrics_follow_the_definitions():
    m = slo.request_metrics([0.2, 0.25, 0.27, 0.40], send_s=0.1)
    assert m["ttft_ms"] == pytest.approx(100.0)
    assert m["e2e_ms"] == pytest.approx(300.0)
    assert m["tpot_ms"] == pytest.approx(200.0 / 3)
    assert m["itl_ms"] == pytest.approx(130.0)
    assert slo.request_metrics([0.5], 0.0)["tpot_ms"] == 0.0


def test_good_means_every_target_met_inclusive_and_failed_requests_never_good():
    target = {"ttft_ms": 100.0, "tpot_ms": 10.0}
    good = {"ttft_ms": 100.0, "tpot_ms": 10.0, "output_tokens": 5}
    late = {"ttft_ms": 100.1, "tpot_ms": 1.0, "output_tokens": 7}
    failed = {"ok": False, "ttft_ms": 1.0, "tpot_ms": 1.0, "output_tokens": 3}
    assert slo.is_good(good, target) and not slo.is_good(late, target) and not slo.is_good(failed, target)
    g = slo.goodput([good, late, failed], target, duration_s=2.0)
    assert g == {"goodput_requests_per_s": 0.5, "goodput_tokens_per_s": 2.5, "attainment": pytest.approx(1 / 3)}


def test_a_failed_request_counts_as_infinitely_late_in_percentiles():
    reqs = [{"ttft_ms": float(i)} for i in range(99)] + [{"ok": False}]
    assert slo.percentile(reqs, "ttft_ms", 100) == math.inf
    assert slo.percentile(reqs, "ttft_ms", 50) == 50.0
    assert slo.worst_metric(reqs, {"ttft_ms": 99.0}, 50) == ("ttft_ms", pytest.approx(50 / 99))
