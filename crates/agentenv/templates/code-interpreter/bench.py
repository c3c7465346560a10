"""Figures of the code-interpreter template against a running agentenv server (E2B_API_URL, E2B_API_KEY):
the template's build time (skipped with --no-build when it exists), create from it and `run_code("1+1")` round
trips, medians over --n, each through the stock SDKs. Prints one JSON object.

    python3 bench.py --n 10
"""

import argparse
import json
import statistics
import time

from e2b_code_interpreter import Sandbox

import template


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--no-build", action="store_true")
    a = p.parse_args()
    out = {"template": template.NAME, "n": a.n}
    if not a.no_build:
        t = time.perf_counter()
        template.build()
        out["build_s"] = round(time.perf_counter() - t, 1)
    creates, runs = [], []
    for _ in range(a.n):
        t = time.perf_counter()
        sbx = Sandbox.create(timeout=120)
        creates.append((time.perf_counter() - t) * 1000)
        try:
            for _ in range(5):
                t = time.perf_counter()
                assert sbx.run_code("1+1").text == "2"
                runs.append((time.perf_counter() - t) * 1000)
        finally:
            sbx.kill()
    out["create_ms_p50"] = round(statistics.median(creates), 1)
    out["run_code_ms_p50"] = round(statistics.median(runs), 1)
    out["run_code_first_ms_p50"] = round(statistics.median(runs[::5]), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
