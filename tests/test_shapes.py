"""The one validation layer for model shapes: whole, positive, finite, bounded, consistent; files read with a limit."""
import math
import os

import pytest

from engine.plan import shapes
from engine.plan.shapes import ShapeError


@pytest.mark.parametrize("value", [2.7, True, False, "32", [32], None, math.nan, math.inf, 10**400, 0, -5])
def test_whole_numbers_refuse_everything_else(value):
    with pytest.raises(ShapeError, match="layers must be a whole number from 1 to"):
        shapes.whole("layers", value)


def test_whole_numbers_accept_ints_and_integral_floats():
    assert shapes.whole("layers", 32) == 32
    assert shapes.whole("layers", 32.0) == 32 and isinstance(shapes.whole("layers", 32.0), int)
    assert shapes.whole("context", 0, 0) == 0
    with pytest.raises(ShapeError, match="from 1 to 10,000"):
        shapes.whole("layers", 10_001)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400, 1e400, 0, -1, True, "7e9"])
def test_numbers_must_be_finite_and_positive(value):
    with pytest.raises(ShapeError, match="params must be a"):
        shapes.number("params", value)


def test_attention_fields_must_agree_with_each_other():
    assert shapes.check_attention(32, 32, 8, 128)["kv_heads"] == 8
    with pytest.raises(ShapeError, match="cannot exceed"):
        shapes.check_attention(32, 8, 32, 128)
    with pytest.raises(ShapeError, match="divide"):
        shapes.check_attention(32, 32, 5, 128)
    with pytest.raises(ShapeError, match="sliding_layers must be a whole number from 0 to 32"):
        shapes.check_attention(32, 32, 8, 128, window=128, sliding_layers=1000)
    with pytest.raises(ShapeError, match="sliding_layers"):
        shapes.check_attention(32, 32, 8, 128, window=128, sliding_layers=-5)
    with pytest.raises(ShapeError, match="need a sliding window"):
        shapes.check_attention(32, 32, 8, 128, sliding_layers=4)
    assert shapes.check_attention(61, 128, 128, 128, kind="MLA", latent_dim=576)["latent_dim"] == 576


def test_json_files_are_read_with_a_limit_and_only_when_regular(tmp_path):
    good = tmp_path / "config.json"
    good.write_text('{"num_hidden_layers": 2}')
    assert shapes.read_json_file(good) == {"num_hidden_layers": 2}
    with pytest.raises(ShapeError, match="is a folder"):
        shapes.read_json_file(tmp_path)
    with pytest.raises(ShapeError, match="No config.json at"):
        shapes.read_json_file(tmp_path / "missing.json")
    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    with pytest.raises(ShapeError, match="not a regular file"):
        shapes.read_json_file(pipe)  # refused before opening: a named pipe would block the reader
    big = tmp_path / "big.json"
    big.write_text("{" + " " * 2000 + "}")
    with pytest.raises(ShapeError, match="larger than 1 KiB"):
        shapes.read_json_file(big, max_bytes=1024)
    with pytest.raises(ShapeError, match="not an object"):
        shapes.parse_json_bytes(b"[1]", "x.json")
    with pytest.raises(ShapeError, match="not valid JSON"):
        shapes.parse_json_bytes(b"\xff\xfe", "x.json")
