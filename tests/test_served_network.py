"""A served request's network parts from the HTTP client's trace hooks, the server's prefix-cache counters
around a run and a load level, and the load sweep's shared-prefix workload, against small real servers
(tests/load_server.py, whose prefix cache and prefill time are known, and tests/stream_server.py, which
has no /metrics)."""
import json
import socket
import subprocess

import pandas as pd
import pytest

from engine.cli.main import main
from engine.measure.distances import BUCKETS
from engine.serve import network
from engine.serve import records as served_store
from engine.serve.load import Sweep, SweepConfig

from test_load import known_server  # noqa: F401 (the fixture)
from test_served import served_run, stream_server  # noqa: F401 (the fixture)

PARTS = list(network.PARTS)
PHYSICAL = list(network.PHYSICAL)  # the parts without dns_ms, which lies inside connect_ms
PROMPT = " ".join(f"word{i}" for i in range(40))  # 40 tokens to the known server: two whole blocks and a half


def test_a_served_run_stores_its_network_parts_in_order_and_they_make_its_physical_bucket(known_server, store,  # noqa: F811
                                                                                          monkeypatch):
    url = known_server(slots=1, step_s=0.01)
    lookups = []
    resolve = socket.getaddrinfo

    def counted(host, *args, **kwargs):  # the system's resolver, its calls counted while a request is traced
        if getattr(network._current, "trace", None) is not None:
            lookups.append(host)
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counted)
    for root, lookup in ((url, False), (url.replace("127.0.0.1", "localhost"), True)):
        lookups.clear()
        run = served_run(root, store, prompt=PROMPT, max_new_tokens=4)
        list(run)
        row = store.run(run.run_id)
        parts = {p: row[p] for p in PHYSICAL}
        # the run's request has a connection of its own: it pays the connect, and a name its lookup
        assert row["connection"] == "new" and row["connect_ms"] > 0 and row["tls_ms"] == 0  # plain http: no TLS
        assert (row["dns_ms"] > 0) == lookup
        # the request's connection looks its name up once, inside its connect, and counts it there once
        assert lookups.count("localhost") == (1 if lookup else 0)
        assert 0 <= row["dns_ms"] < row["connect_ms"]
        assert all(v >= 0 for v in parts.values()) and row["send_ms"] > 0 and row["first_byte_ms"] > 0
        # one clock: the parts come before the response headers, which come before the first token
        assert sum(parts.values()) <= row["headers_ms"] <= row["ttft_ms"]
        assert row["physical_ms"] == pytest.approx(sum(parts.values()))
        # the five buckets (server work unsplit without a GPU) still sum to the measured time
        buckets = [row[f"{b}_ms"] for b in BUCKETS]
        assert sum(v for v in buckets if pd.notna(v)) + row["server_work_ms"] == pytest.approx(row["total_ms"])
        provenance = json.loads(row["provenance"])["physical"]
        assert provenance["source"] == "client" and "trace hooks" in provenance["how"] and "new connection" in provenance["how"]
        steps = store.query("SELECT physical_ms FROM steps WHERE run_id = ? ORDER BY step", [run.run_id])["physical_ms"]
        assert steps.iloc[0] == pytest.approx(row["physical_ms"]) and (steps.iloc[1:] == 0).all()


def test_an_https_run_records_its_tls_handshake(known_server, store, tmp_path, monkeypatch):  # noqa: F811
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts the test's own certificate
    url = known_server(slots=1, step_s=0.01, extra=["--cert", str(cert), "--key", str(key)])
    run = served_run(url.replace("http://127.0.0.1", "https://localhost"), store, prompt=PROMPT, max_new_tokens=3)
    list(run)
    row = store.run(run.run_id)
    assert row["connection"] == "new" and row["tls_ms"] > 0 and 0 < row["dns_ms"] < row["connect_ms"]
    assert row["physical_ms"] == pytest.approx(sum(row[p] for p in PHYSICAL)) and row["physical_ms"] <= row["headers_ms"]
    assert row["prefix_cache_hit_rate"] == 0.0  # its /metrics, read over HTTPS too


def test_a_runs_prefix_cache_hit_rate_is_the_counters_difference_around_it(known_server, store):  # noqa: F811
    url = known_server(slots=1, step_s=0.01)
    rows = []
    for _ in range(2):
        run = served_run(url, store, prompt=PROMPT, max_new_tokens=3)
        list(run)
        rows.append(store.run(run.run_id))
    # the first finds nothing; the second finds the two whole blocks of 16 the first left, of its 40 tokens
    # (the counters then read 32 of 80 in all, so an undifferenced reading would say 40 %)
    assert [r["prefix_cache_queries"] for r in rows] == [40, 40]
    assert [r["prefix_cache_hits"] for r in rows] == [0, 32]
    assert [r["prefix_cache_hit_rate"] for r in rows] == [0.0, 0.8]
    assert json.loads(rows[1]["provenance"])["prefix_cache"]["source"] == "server"


def test_a_server_without_prefix_counters_leaves_them_empty_never_zero(stream_server, store):  # noqa: F811
    url, _ = stream_server("ok")
    run = served_run(url, store, max_new_tokens=4)
    list(run)
    row = store.run(run.run_id)
    assert pd.isna(row["prefix_cache_queries"]) and pd.isna(row["prefix_cache_hit_rate"])
    assert json.loads(row["provenance"])["prefix_cache"]["source"] == "none"
    assert row["connection"] == "new" and row["first_byte_ms"] > 0


def test_a_request_on_a_kept_alive_connection_is_recorded_as_reused(known_server, store):  # noqa: F811
    url = known_server(slots=1, step_s=0.005)
    summary = Sweep(SweepConfig(url, [1], requests=3, output_tokens=2, input_tokens=5), store).run()
    rows = served_store.sweep_requests(store, summary["sweep_id"]).sort_values("idx").to_dict("records")
    # the first request rides the connection the model listing left open; the server closes each stream's
    # connection after it, so the next ones connect anew
    first, *rest = rows
    assert first["connection"] == "reused" and first["connect_ms"] == first["dns_ms"] == first["tls_ms"] == 0
    assert all(r["connection"] == "new" and r["connect_ms"] > 0 for r in rest)
    level = summary["levels"][0]
    assert level["connections_reused"] == 1 and level["physical_ms"]["mean"] == pytest.approx(
        sum(r["physical_ms"] for r in rows) / 3)
    for r in rows:
        assert r["send_ms"] > 0 and r["first_byte_ms"] > 0
        assert r["physical_ms"] == pytest.approx(sum(r[p] for p in PHYSICAL))
        assert r["physical_ms"] <= r["headers_ms"] <= r["ttft_ms"]


def test_a_shared_prefix_sweep_shares_its_prefix_and_the_cache_hits_cut_the_first_token_time(known_server, store,  # noqa: F811
                                                                                             tmp_path, capsys):
    log = tmp_path / "prompts.jsonl"
    url = known_server(slots=2, step_s=0.005, extra=["--prefill-ms-per-token", "4", "--log", str(log)])
    db = str(store.path)
    code = main(["load", "--endpoint", url, "--concurrency", "1,2", "--requests", "4", "--output-tokens", "2",
                 "--input-tokens", "8", "--shared-prefix-tokens", "64", "--db", db])
    assert code == 0, capsys.readouterr().err
    prompts = [json.loads(line)["prompt"].split() for line in log.read_text().splitlines()]
    assert len(prompts) == 8 and all(len(p) == 72 for p in prompts)
    assert len({tuple(p[:64]) for p in prompts}) == 1 and len({tuple(p[64:]) for p in prompts}) == 8
    sweep = served_store.sweeps(store).iloc[0]
    assert json.loads(sweep["config"])["shared_prefix_tokens"] == 64
    first, second = json.loads(sweep["levels"])
    # level 1: only its first request misses the 64 shared tokens; level 2: all four find them
    assert (first["prefix_cache_queries"], first["prefix_cache_hits"]) == (4 * 72, 3 * 64)
    assert first["prefix_cache_hit_rate"] == pytest.approx(3 * 64 / (4 * 72))
    assert second["prefix_cache_hit_rate"] == pytest.approx(64 / 72)
    # a hit skips 64 tokens of prefill at 4 ms each: the first request waits that much longer for its first token
    requests = served_store.sweep_requests(store, int(sweep["sweep_id"]))
    level = requests[requests["level"] == 0].sort_values("idx")["ttft_ms"].tolist()
    assert level[0] - max(level[1:]) > 64 * 4 / 2
    assert "cached" in capsys.readouterr().out

    # the stored sweep made again sends the same prefix (the same seed gives the same words)
    code = main(["load", "--from-sweep", str(sweep["sweep_id"]), "--db", db])
    assert code == 0
    again = [json.loads(line)["prompt"].split() for line in log.read_text().splitlines()][8:]
    assert len(again) == 8 and {tuple(p[:64]) for p in again} == {tuple(prompts[0][:64])}
    assert json.loads(served_store.sweeps(store).iloc[0]["config"])["shared_prefix_tokens"] == 64


@pytest.mark.parametrize("value", ["0", "-3", "40000", "abc", "1.5"])
def test_a_bad_shared_prefix_is_one_sentence_exit_2_and_nothing_stored(known_server, tmp_path, capsys, value):  # noqa: F811
    url = known_server(slots=1, step_s=0.01)
    db = tmp_path / "x.duckdb"
    try:
        code = main(["load", "--endpoint", url, "--concurrency", "1", "--input-tokens", "4", "--shared-prefix-tokens",
                     value, "--db", str(db)])
    except SystemExit as exc:  # the parser's own refusal of a value that is not a whole number
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "--shared-prefix-tokens" in err and err.count("\n") == 1, err
    if db.exists():
        from engine.store.db import Store

        assert served_store.sweeps(Store(db)).empty


def test_trace_parts_are_none_before_the_response_headers():
    trace = network.RequestTrace(0)
    trace("connection.connect_tcp.started", {})
    assert trace.parts() is None and network.physical_ms(None) is None
    assert network.columns(None) == dict.fromkeys(network.COLUMNS)


def test_the_local_engine_takes_the_shared_prefix_and_reports_no_cache_or_network(tiny_folder, calibration, tmp_path,
                                                                                  capsys):
    db = tmp_path / "runs.duckdb"
    code = main(["load", "--local", "--model", str(tiny_folder), "--concurrency", "2", "--requests", "3",
                 "--input-tokens", "4", "--output-tokens", "2", "--shared-prefix-tokens", "24", "--db", str(db), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["levels"][0]["completed"] == 3
    from engine.store.db import Store

    prompts = Store(db).query("SELECT prompt FROM runs")["prompt"].tolist()
    heads = {p.split("\n\n")[0] for p in prompts}
    assert len(prompts) == 3 and len(heads) == 1 and len(set(prompts)) == 3
    # no HTTP and no prefix-cache counters: nothing recorded, never a zero
    level = out["levels"][0]
    assert level["prefix_cache_hit_rate"] is None and level["physical_ms"]["mean"] is None
    requests = served_store.sweep_requests(Store(db), out["sweep_id"])
    assert requests["connection"].isna().all() and requests["physical_ms"].isna().all()
