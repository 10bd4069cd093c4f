"""The DuckDB schema of the run store, as numbered migrations applied in order.

A migration, once shipped, never changes: a new column or table is a new version."""
from engine.measure.distances import BUCKETS

_BUCKET_COLS = ", ".join(f"{b}_ms DOUBLE" for b in BUCKETS)

MIGRATIONS = {
    1: [
        "CREATE TABLE tokenpath_meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
        "CREATE SEQUENCE run_ids START 1",
        f"""CREATE TABLE runs (
            run_id BIGINT PRIMARY KEY DEFAULT nextval('run_ids'),
            started_at TIMESTAMP, finished_at TIMESTAMP, status VARCHAR,
            model VARCHAR, device VARCHAR, dtype VARCHAR, kv_cache BOOLEAN, temperature DOUBLE,
            config VARCHAR, hardware VARCHAR, prompt VARCHAR, output VARCHAR, token_ids INTEGER[],
            n_prompt_tokens INTEGER, n_new_tokens INTEGER, ttft_ms DOUBLE, tpot_ms DOUBLE,
            tokens_per_s DOUBLE, decode_tokens_per_s DOUBLE, total_ms DOUBLE,
            itl_p50_ms DOUBLE, itl_p90_ms DOUBLE, itl_p99_ms DOUBLE, {_BUCKET_COLS},
            metrics VARCHAR, error VARCHAR, host VARCHAR, pid INTEGER, pid_started DOUBLE)""",
        f"""CREATE TABLE steps (
            run_id BIGINT, step INTEGER, kind VARCHAR, n_input INTEGER, n_emitted INTEGER,
            context_len INTEGER, draft_ms DOUBLE, upload_ms DOUBLE, forward_ms DOUBLE, sync_ms DOUBLE,
            select_ms DOUBLE, host_ms DOUBLE, wall_ms DOUBLE, weight_bytes BIGINT, kv_read_bytes BIGINT,
            kv_write_bytes BIGINT, flops DOUBLE, memory_est_ms DOUBLE, compute_est_ms DOUBLE,
            roofline_ms DOUBLE, waste_fraction DOUBLE, {_BUCKET_COLS})""",
        f"""CREATE TABLE tokens (
            run_id BIGINT, idx INTEGER, step INTEGER, token_id INTEGER, piece VARCHAR,
            t_ms DOUBLE, gap_ms DOUBLE, {_BUCKET_COLS})""",
        """CREATE TABLE telemetry (
            run_id BIGINT, t_ms DOUBLE, cpu_percent DOUBLE, rss_bytes BIGINT, gpu_util_percent DOUBLE,
            gpu_mem_used_bytes BIGINT, gpu_power_w DOUBLE, gpu_sm_clock_mhz DOUBLE,
            gpu_mem_clock_mhz DOUBLE, gpu_temp_c DOUBLE)""",
        "CREATE TABLE calibration (device_key VARCHAR, created_at TIMESTAMP, results VARCHAR)",
    ],
    2: [
        "ALTER TABLE runs ADD COLUMN quant VARCHAR DEFAULT 'fp32'",
        """CREATE TABLE quality (
            created_at TIMESTAMP, model VARCHAR, device VARCHAR, variant VARCHAR, settings VARCHAR,
            perplexity DOUBLE, kl_mean DOUBLE, top1_agreement DOUBLE, n_tokens INTEGER,
            eval_text_sha VARCHAR, first_divergence INTEGER, seconds DOUBLE)""",
    ],
    3: [
        "ALTER TABLE runs ADD COLUMN sparsity DOUBLE DEFAULT 0",
        "ALTER TABLE runs ADD COLUMN sparsity_mode VARCHAR",
        """CREATE TABLE sparsity_thresholds (model VARCHAR, sparsity DOUBLE, text_sha VARCHAR,
            created_at TIMESTAMP, thresholds VARCHAR)""",
    ],
    4: [
        "ALTER TABLE steps ADD COLUMN drafted INTEGER DEFAULT 0",
        "ALTER TABLE steps ADD COLUMN accepted INTEGER DEFAULT 0",
        "ALTER TABLE runs ADD COLUMN spec VARCHAR DEFAULT 'none'",
    ],
    5: [  # served runs (an OpenAI-compatible server) and load sweeps against one
        "ALTER TABLE runs ADD COLUMN backend VARCHAR DEFAULT 'local'",
        "ALTER TABLE runs ADD COLUMN endpoint VARCHAR",
        "ALTER TABLE runs ADD COLUMN server_model VARCHAR",
        "ALTER TABLE runs ADD COLUMN provenance VARCHAR",  # JSON: figure -> measured by client, server, or estimate
        "ALTER TABLE runs ADD COLUMN server_work_ms DOUBLE",
        "ALTER TABLE steps ADD COLUMN server_work_ms DOUBLE",
        "ALTER TABLE tokens ADD COLUMN server_work_ms DOUBLE",
        "CREATE SEQUENCE sweep_ids START 1",
        """CREATE TABLE load_sweeps (
            sweep_id BIGINT PRIMARY KEY DEFAULT nextval('sweep_ids'), started_at TIMESTAMP, finished_at TIMESTAMP,
            status VARCHAR, endpoint VARCHAR, server_model VARCHAR, config VARCHAR, levels VARCHAR,
            server VARCHAR, error VARCHAR, host VARCHAR, pid INTEGER, pid_started DOUBLE)""",
        """CREATE TABLE requests (
            sweep_id BIGINT, concurrency INTEGER, idx INTEGER, prompt_name VARCHAR, status VARCHAR, error VARCHAR,
            sent_ms DOUBLE, n_prompt_tokens INTEGER, n_output_tokens INTEGER, n_chunks INTEGER, token_source VARCHAR,
            ttft_ms DOUBLE, tpot_ms DOUBLE, e2e_ms DOUBLE, chunk_ms DOUBLE[], chunk_tokens INTEGER[])""",
        """CREATE TABLE load_samples (
            sweep_id BIGINT, concurrency INTEGER, t_ms DOUBLE, running DOUBLE, waiting DOUBLE, kv_cache_usage DOUBLE)""",
    ],
    6: [  # a run's tag, such as story:memory:fp32, so a page finds the runs it made again
        "ALTER TABLE runs ADD COLUMN tag VARCHAR",
    ],
    7: [  # a served run's token rows made by the model's tokenizer from the streamed text, not the server's ids
        "ALTER TABLE tokens ADD COLUMN retokenised BOOLEAN",
    ],
    8: [  # load sweeps at a request rate: each request's level, rate and schedule, goodput, capacity searches
        "ALTER TABLE load_sweeps ADD COLUMN kind VARCHAR",  # concurrency, rate or capacity
        "ALTER TABLE load_sweeps ADD COLUMN result VARCHAR",  # JSON: a capacity search's answer
        "ALTER TABLE requests ADD COLUMN level INTEGER",  # the level's position in the sweep, -1 for warm-up
        "ALTER TABLE requests ADD COLUMN rate DOUBLE",
        "ALTER TABLE requests ADD COLUMN warmup BOOLEAN",
        "ALTER TABLE requests ADD COLUMN scheduled_ms DOUBLE",  # its arrival; sent_ms later when the client held it
        "ALTER TABLE requests ADD COLUMN good BOOLEAN",  # met every target of the sweep's SLO
        "ALTER TABLE load_samples ADD COLUMN level INTEGER",
        "ALTER TABLE load_samples ADD COLUMN in_flight DOUBLE",  # requests sent and not yet ended, by the client
    ],
    9: [  # batching: how many sequences shared each step's forward
        "ALTER TABLE steps ADD COLUMN batch INTEGER DEFAULT 1",
    ],
    10: [  # a served request's network parts from the HTTP client's trace hooks; the server's prefix-cache counters
        *(f"ALTER TABLE {table} ADD COLUMN {c} DOUBLE" for table in ("runs", "requests")
          for c in ("dns_ms", "connect_ms", "tls_ms", "send_ms", "first_byte_ms", "headers_ms")),
        "ALTER TABLE runs ADD COLUMN connection VARCHAR",  # new, or reused (a kept-alive connection: no connect)
        "ALTER TABLE requests ADD COLUMN connection VARCHAR",
        "ALTER TABLE requests ADD COLUMN physical_ms DOUBLE",  # the parts' sum
        "ALTER TABLE runs ADD COLUMN prefix_cache_queries DOUBLE",  # prompt tokens looked up, counters' difference
        "ALTER TABLE runs ADD COLUMN prefix_cache_hits DOUBLE",  # prompt tokens found in the cache
        "ALTER TABLE runs ADD COLUMN prefix_cache_hit_rate DOUBLE",  # NULL where the server has no such counters
    ],
    11: [  # a sweep's full specification (engine/sweep.py), stored before its first run
        "CREATE TABLE sweeps (sweep_id VARCHAR PRIMARY KEY, created_at TIMESTAMP, spec VARCHAR)",
    ],
    12: [  # a local run's energy from its device's counters (RAPL, NVML) at its start and end
        "ALTER TABLE runs ADD COLUMN energy_j DOUBLE",  # NULL where no counter could be read: never an estimate
        "ALTER TABLE runs ADD COLUMN energy_source VARCHAR",  # the counters read
        "ALTER TABLE runs ADD COLUMN energy_note VARCHAR",  # why energy_j is NULL
    ],
    13: [  # one word for each idea: the weight level is "weights", the speculative method "speculative"
        "ALTER TABLE runs RENAME COLUMN quant TO weights",
        "ALTER TABLE runs RENAME COLUMN spec TO speculative",
    ],
}
SCHEMA_VERSION = max(MIGRATIONS)
