"""Hardware: device facts, calibration, live telemetry, links, and the path data travels."""
import math

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine.measure import hardware
from engine.model.loader import pick_device
from ui import LEGEND, device_facts, md_escape, open_store, page_setup, show_calibration_verdict

page_setup("Hardware")
st.title("Hardware")
device = pick_device("auto")
facts = device_facts("auto")
store = open_store()

c = st.columns(2)
with c[0]:
    st.subheader("This machine")
    cpu = facts["cpu"]
    st.markdown(f"- CPU: **{cpu['model']}**, {cpu['physical_cores']} physical / {cpu['logical_cores']} logical cores, "
                f"torch uses {cpu['torch_threads']} threads\n- RAM: {cpu['ram_bytes'] / 2**30:.1f} GiB "
                f"({cpu['ram_bytes'] / 1e9:.1f} GB)\n- torch {facts['torch']}, generation device **{device}**\n"
                f"- OpenMP threads between parallel regions: {md_escape(cpu['openmp_wait'])}\n"
                f"- memory freed by a process: {md_escape(cpu['freed_memory'])}\n"
                f"- pages: {md_escape(cpu['huge_pages'])}")
    gpu = facts["gpu"]
    if not gpu["available"]:
        st.info(f"No NVIDIA GPU here: {gpu['reason']}. Runs use the {device.type}.")
    for g in gpu["gpus"]:
        st.markdown(f"- GPU {g['index']}: **{g['name']}**, {g['memory_total_bytes'] / 2**30:.1f} GiB, "
                    f"PCIe gen {g['pcie_gen']} x{g['pcie_width']} (max gen {g['pcie_max_gen']} x{g['pcie_max_width']}), "
                    f"{g['nvlink_links_up']} NVLink links up")

with c[1]:
    st.subheader("Calibration")
    key = hardware.device_key(device)
    verdict = show_calibration_verdict(store, "hardware", always_offer=True)
    recent = hardware.recent_calibrations(store, key) if store is not None else []
    stored = verdict.calibration
    if stored is not None:
        methods = stored.get("memory_methods_gbps") or {"streaming sum": stored["stream_read_gbps"]}
        rows = [(f"memory read peak (best method: {stored.get('memory_method', 'gemv')})", f"{stored['memory_gbps']:.1f} GB/s"),
                *[(f"memory read, {name.replace('_', ' ')}", f"{gbps:.1f} GB/s") for name, gbps in methods.items()],
                *[(f"matmul peak, {dtype}", f"{v:.0f} GFLOP/s") for dtype, v in stored["matmul_gflops"].items()],
                ("dispatch cost per operation", f"{stored['dispatch_us']:.1f} µs")]
        if "matvec_call_us" in stored:
            rows.append(("a 4 MB matrix-vector product, beyond its bytes", f"{stored['matvec_call_us']:.1f} µs"))
        rows += hardware.cache_read_rows(stored)
        if "host_link" in stored:
            link = stored["host_link"]
            rows += [("host to device", f"{link['h2d_gbps']:.1f} GB/s, {link['h2d_latency_us']:.0f} µs"),
                     ("device to host", f"{link['d2h_gbps']:.1f} GB/s, {link['d2h_latency_us']:.0f} µs")]
        st.dataframe(pd.DataFrame(rows, columns=["measurement", "value"]), hide_index=True, width="stretch",
                     height=35 * (len(rows) + 1) + 3)  # every row in view
        st.caption(f"In use on {md_escape(key)} (where it came from: the verdict above). The attribution divides each "
                   "forward's bytes and FLOPs by the peaks; the planner's estimate for this machine reads weights at "
                   "the small-rows kernel's figure (the one fp32 decode steps run), or, where a step's bytes stay in "
                   "the last-level cache, at the rate of its re-reads (on the line between the two sizes re-read), "
                   "and adds the product cost. Runs use the newest calibration that is within "
                   f"{1 - hardware.DISAGREEMENT:.0%} of the best recent figures; one taken while other work shared "
                   "the machine reads low and is flagged.")
        with st.expander(f"The last {len(recent)} calibration(s) of this device"):
            st.dataframe(pd.DataFrame([{
                "measured (UTC)": r.get("measured_at") or r["created_at"],
                "from": "this machine's calibration cache" if r.get("reused_from") else "measured for this database",
                "memory GB/s": round(r["memory_gbps"], 1),
                "fp32 GFLOP/s": round(r["matmul_gflops"]["float32"]), "in use": r["created_at"] == stored["created_at"],
                "flag": r.get("suspect") or ""} for r in recent]), hide_index=True, width="stretch")

st.subheader("Links and bandwidths")
links = []
if stored:
    links.append({"path": f"DRAM -> CPU cores (read peak, {stored.get('memory_method', 'gemv').replace('_', ' ')})",
                  "bandwidth GB/s": round(stored["memory_gbps"], 1), "source": "calibration"})
for g in facts["gpu"]["gpus"]:
    links.append({"path": f"host <-> {g['name']} over PCIe (current link)", "bandwidth GB/s": g["pcie_bandwidth_gbps"],
                  "source": "NVML generation x width"})
    links.append({"path": f"HBM -> {g['name']} (theoretical)", "bandwidth GB/s": g["memory_theoretical_gbps"],
                  "source": "NVML bus width x memory clock"})
if links:
    st.dataframe(pd.DataFrame(links), hide_index=True, width="stretch")


def round_axis(highest: float, ticks: int = 4) -> dict:
    """An axis from 0 with about `ticks` round steps (1, 2 or 5 times a power of ten) over the highest value and
    some room, so its labels read 0, 0.2, 0.4, 0.6 rather than Plotly's split of an odd range, and its line is
    drawn below the top."""
    room = max(highest, 1e-9) * 1.2
    power = 10 ** math.floor(math.log10(room / ticks))
    step = next(m * power for m in (1, 2, 5, 10) if m * power * ticks >= room)
    return {"range": [0, step * math.ceil(room / step)], "dtick": step}


@st.fragment(run_every=1.0)
def live_telemetry():
    history = st.session_state.setdefault("telemetry", [])
    sampler = st.session_state.setdefault("sampler", hardware.TelemetrySampler(device))
    history.append(sampler.sample())
    del history[:-120]
    frame = pd.DataFrame(history)
    fig = go.Figure()
    fig.add_scatter(x=frame["t_ms"] / 1e3, y=frame["cpu_percent"], name="CPU use, % of all cores (whole machine)",
                    mode="lines")
    fig.add_scatter(x=frame["t_ms"] / 1e3, y=frame["rss_bytes"] / 1e9, name="this server's resident memory, GB",
                    mode="lines", yaxis="y2")
    fig.update_layout(xaxis_title="seconds since this page opened",
                      # a little room over 100 %, so a saturated machine's line is not hidden by the frame
                      yaxis=dict(title="CPU %", range=[0, 105], dtick=25),
                      yaxis2=dict(title="GB", overlaying="y", side="right", showgrid=False,
                                  **round_axis(frame["rss_bytes"].max() / 1e9)),
                      height=260, margin=dict(l=40, r=40, t=40, b=40), legend=LEGEND)
    st.plotly_chart(fig, width="stretch")


st.subheader("Live telemetry")
st.caption("Sampled once a second while this page is open (CPU use of the whole machine since the previous "
           "sample, and this server's resident memory; NVML figures on a GPU). The first CPU figure comes one "
           "sample in: a share of time needs an interval to be measured over.")
live_telemetry()

st.subheader("The path data travels: a DGX A100")
stages = [("HBM2", "weights and\nKV cache"), ("GPU", "compute\nunits"), ("GPU module\nboard", "carries\neach GPU"),
          ("UBB\nbaseboard", "~0.30 m², 26 layers,\nultra-low-loss,\n≈3,000 CNY"), ("NVSwitch", "GPU to GPU"),
          ("PCIe to host", "CPU, DRAM,\nNICs")]
fig = go.Figure()
for i, (name, what) in enumerate(stages):
    x = i * 1.7
    fig.add_shape(type="rect", x0=x, x1=x + 1.3, y0=0, y1=1, line_color="#1f6f8b", fillcolor="#e8f1f5")
    fig.add_annotation(x=x + 0.65, y=0.75, text=f"<b>{name.replace(chr(10), '<br>')}</b>", showarrow=False,
                       font_size=12)
    fig.add_annotation(x=x + 0.65, y=0.3, text=what.replace("\n", "<br>"), showarrow=False, font_size=10)
    if i:
        fig.add_annotation(x=x, y=0.5, ax=x - 0.4, ay=0.5, xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=2, text="")
fig.update_xaxes(visible=False, range=[-0.2, len(stages) * 1.7])
fig.update_yaxes(visible=False, range=[-0.2, 1.2])
fig.update_layout(height=260, margin=dict(l=0, r=0, t=0, b=0), plot_bgcolor="white")
st.plotly_chart(fig, width="stretch")
st.markdown(
    "Industry estimates, not measured here: in a DGX A100 the GPU baseboard, NVSwitch, GPU "
    "cards and GPU module boards use about **0.624 m² of PCB worth about 12,250 CNY per system**; the UBB that "
    "carries the GPU platform is about **0.30 m², 26 layers of through-hole design on ultra-low-loss material, "
    "about 3,000 CNY**. Multi-layer low-loss boards exist to keep these signal paths short and clean: the "
    "*physical* distance. On this page's machine the same idea shows as the calibrated bandwidths above, and in "
    "each run as the physical bucket (upload, download, sync)."
)
