"""Switches are registry entries: a level or method registered anywhere shows up everywhere that lists them."""
import pytest
import torch

from engine.switches import quant
from engine.switches import speculative
from engine.cli.main import build_parser
from engine.switches.drafters import Drafter
from engine.run.generate import Generation, GenConfig
from engine.switches.quant import LevelInfo, WeightLevel


class HalfOfFp32(WeightLevel):
    """A test level: the weights rounded to bf16 and back, stored in fp32."""
    name = "test-bf16-rounded"
    help = "fp32 storage of bf16-rounded weights"

    def info(self, device):
        return LevelInfo(self.name, "dense fp32 GEMV/GEMM", True, self.help)

    def convert(self, lm, model, group_size):
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).float()


class RepeatLast(Drafter):
    """A test drafter: guesses that the last token repeats."""
    def propose(self, ids, k, sample=None, generator=None):
        return [ids[-1]] * k


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(quant.LEVELS, HalfOfFp32.name, HalfOfFp32())
    monkeypatch.setitem(speculative.METHODS, "test-repeat",
                        speculative.Method("test-repeat", "repeat the last token", lambda t, c, load: RepeatLast()))


def parses(*argv) -> bool:
    try:
        build_parser().parse_args(["generate", "--prompt", "x", *argv])
        return True
    except SystemExit:
        return False


def test_a_level_and_a_method_defined_here_reach_the_command_line_and_the_level_table(registered):
    assert parses("--weights", HalfOfFp32.name) and parses("--speculative", "test-repeat")
    import ui

    assert HalfOfFp32.name in set(ui.level_table("cpu")["level"])
    assert HalfOfFp32.name in quant.available_levels(torch.device("cpu"))


def test_unregistered_names_are_refused():
    assert not parses("--weights", HalfOfFp32.name) and not parses("--speculative", "test-repeat")


def test_a_registered_level_and_method_run_and_greedy_output_is_unchanged(registered, tiny_lm, calibration):
    lm = quant.variant(tiny_lm, HalfOfFp32.name)
    assert lm.weights == HalfOfFp32.name and lm.dtype == torch.float32
    plain = Generation(lm, GenConfig("Hello there", raw=True, max_new_tokens=8, ignore_eos=True),
                       calibration=calibration, telemetry=False).run()
    guessed = Generation(lm, GenConfig("Hello there", raw=True, max_new_tokens=8, ignore_eos=True, speculative="test-repeat"),
                         calibration=calibration, telemetry=False).run()
    assert guessed["token_ids"] == plain["token_ids"]
    assert guessed["speculative"]["drafted"] > 0
