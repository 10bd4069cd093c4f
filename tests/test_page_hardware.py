"""The Hardware page's live telemetry through Streamlit's AppTest: CPU use on 0-100 % (with room for a line at
100 %), the server's memory in GB on an axis from zero with round steps and room above its line."""
import base64
import json
import math

import numpy as np
import plotly.graph_objects as go
from streamlit.testing.v1 import AppTest


def values(array) -> list[float]:
    """A trace's numbers, as Plotly writes them: a list, or a typed array in base64."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"]).tolist()
    return list(array)


def test_the_telemetry_axes_read_round_figures_with_the_lines_inside(page_db):
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.switch_page("pages/hardware.py")
    at.run()
    assert not at.exception
    telemetry = go.Figure(next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                               if "this server's resident memory, GB" in c.proto.spec))
    layout = telemetry.layout
    assert layout.yaxis.range[0] == 0 and 100 < layout.yaxis.range[1] < 125 and layout.yaxis.dtick == 25
    memory = next(trace for trace in telemetry.data if trace.yaxis == "y2")
    low, high = layout.yaxis2.range
    step = layout.yaxis2.dtick
    assert low == 0 and 0 < max(values(memory.y)) < high  # the line below the top, not on the edge
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 5))  # 0.1, 0.2, 0.5, 1, 2 ... GB a step
    assert math.isclose(high / step, round(high / step))  # the top is a tick
    assert 2 <= round(high / step) <= 8  # a handful of ticks, each a round figure
