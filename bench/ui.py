"""What the page costs: the same greedy generation streamed through the Live generation page in a
real browser (Debian's Chromium) and run from the command line, alternating in one run. Compares
decode tokens/s (1000 / TPOT) of the recorded runs.

    .venv/bin/python bench/ui.py [--rounds 3] [--tokens 64]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from browser import browser_page, serve_app  # noqa: E402
from engine.store import Store  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def through_page(page, url, store, tokens):
    before = set(store.runs(1000)["run_id"])
    page.goto(url + "/live")
    page.get_by_label("Prompt text").fill(PROMPT)
    page.get_by_label("Max new tokens").fill(str(tokens))
    page.get_by_role("button", name="Generate").click()
    page.get_by_text("TTFT").wait_for(timeout=300_000)
    new = store.runs(1000)
    row = new[~new["run_id"].isin(before)].iloc[0]
    return 1e3 / row["tpot_ms"]


def from_cli(db, tokens):
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", PROMPT, "--max-new-tokens",
                          str(tokens), "--json", "--db", str(db)], cwd=ROOT, capture_output=True, text=True, check=True)
    return 1e3 / json.loads(out.stdout)["tpot_ms"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    db = Path(tempfile.mkdtemp()) / "ui.duckdb"
    store = Store(db)
    page_rates, cli_rates = [], []
    with serve_app(db) as url, browser_page() as page:
        through_page(page, url, store, 4)  # the first page run loads the model into the server
        for i in range(args.rounds):
            for name in (["page", "cli"] if i % 2 == 0 else ["cli", "page"]):
                if name == "page":
                    page_rates.append(through_page(page, url, store, args.tokens))
                else:
                    cli_rates.append(from_cli(db, args.tokens))
    page_med, cli_med = statistics.median(page_rates), statistics.median(cli_rates)
    print(f"greedy fp32, up to {args.tokens} new tokens, {args.rounds} rounds alternating, browser open throughout")
    print(f"streamed through the page: median {page_med:.2f} decode tok/s ({', '.join(f'{r:.2f}' for r in page_rates)})")
    print(f"command line:              median {cli_med:.2f} decode tok/s ({', '.join(f'{r:.2f}' for r in cli_rates)})")
    print(f"page / command line: {page_med / cli_med:.3f} (the page costs {1 - page_med / cli_med:.1%})")


if __name__ == "__main__":
    main()
