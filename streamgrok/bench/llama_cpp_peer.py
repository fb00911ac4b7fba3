"""llama.cpp as the CPU peer of `python -m benchmarks decode --peer llama.cpp`: its own
`llama-bench` (prefill, batch-1 decode) and `llama-batched-bench` (aggregate decode of N
sequences) on the same GGUF and thread count, with each run's peak RSS."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


class PeerUnavailable(RuntimeError):
    """llama.cpp's benchmark programs are not where they were looked for."""


@dataclass
class PeerRun:
    output: str
    peak_rss_mb: float


def find_binaries(folder: str | None) -> dict[str, Path]:
    """`llama-bench` and `llama-batched-bench` in `folder` (or on PATH)."""
    found = {}
    for name in ("llama-bench", "llama-batched-bench"):
        path = Path(folder) / name if folder else shutil.which(name)
        if path is None or not Path(path).is_file():
            raise PeerUnavailable(f"{name} not found{' in ' + folder if folder else ' on PATH'}"
                                  " (build llama.cpp: see DESIGN notes; give --peer-bin DIR)")
        found[name] = Path(path)
    return found


def run_peer(binaries: dict[str, Path], model: Path, threads: int, prompt_tokens: int,
             batch1_tokens: int, context: int, sequences: list[int],
             repeats: int) -> dict:
    """The peer's numbers, in the same keys as streamgrok's decode worker."""
    bench = _run([str(binaries["llama-bench"]), "-m", str(model), "-t", str(threads),
                  "-p", str(prompt_tokens), "-n", str(batch1_tokens), "-r", str(repeats),
                  "-o", "json"])
    results: dict = {"weights": "llama.cpp", "peak_rss_mb": bench.peak_rss_mb}
    for row in json.loads(bench.output):
        speeds = row.get("samples_ts") or [row["avg_ts"]]
        if row.get("n_prompt") and not row.get("n_gen"):
            results["prefill_tok_s"] = statistics.median(speeds)
        elif row.get("n_gen") and not row.get("n_prompt"):
            results["decode_b1_tok_s"] = statistics.median(speeds)
    for n in sequences:
        speeds = []
        for _ in range(repeats):
            run = _run([str(binaries["llama-batched-bench"]), "-m", str(model), "-t",
                        str(threads), "-c", str(n * (context + 64) + 64), "-b", "2048",
                        "-ub", "512", "-npp", str(context), "-ntg", "64", "-npl", str(n),
                        "--output-format", "jsonl"])
            results["peak_rss_mb"] = max(results["peak_rss_mb"], run.peak_rss_mb)
            rows = [json.loads(line) for line in run.output.splitlines()
                    if line.startswith("{")]
            speeds += [row["speed_tg"] for row in rows if row.get("pl") == n]
        results[f"decode_b{n}_tok_s"] = statistics.median(speeds)
    return results


def _run(command: list[str]) -> PeerRun:
    """Run a peer program, polling its peak RSS; its stdout is the result."""
    from streamgrok.bench.timing import measurement_env

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=measurement_env())
    watched = psutil.Process(process.pid)
    peak = 0
    while process.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.05)
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise PeerUnavailable(f"{Path(command[0]).name} failed ({process.returncode}): "
                              f"{stderr.strip()[-400:]}")
    return PeerRun(stdout, peak / 2**20)
