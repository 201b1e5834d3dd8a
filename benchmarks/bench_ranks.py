"""Benchmark (not a test): memory per rank of ``mcore-cpu-shim convert import`` at 1, 2, 4 ranks.

Does splitting a conversion over ranks split its memory? For each N of ``--ranks`` (default
1,2,4) one ``convert import --verify --ranks N --tp N`` of the same Llama-like model, measured as
``bench_convert`` measures one rank (its presets, its ranks, its per-phase peak: the rank's own
high-water mark, reset at every phase, plus its children's private memory). Printed per N:

  per-rank peak   the largest rank's peak from start to the end of save (and which rank)
  summed peak     every rank's peak to the end of save, added up (an upper bound of the ranks'
                  memory at one time)
  verify peak     the largest rank's peak in verify (reload and compare, not the conversion)

next to the model's bytes and the start-up cost of one rank (its peak after the imports:
interpreter, torch, megatron-core, Megatron-Bridge, transformers), and the goal: summed peak <=
1.3 x model + N x start-up, per-rank peak about model / N + start-up.

RSS counts the pages of the memory-mapped safetensors files a rank touched: a page of the page
cache that two ranks read counts in both.

    python benchmarks/bench_ranks.py --size tiny              # smoke run
    python benchmarks/bench_ranks.py --size 1B --ranks 1,2,4
    python benchmarks/bench_ranks.py --hf ~/models/SomeLlama --ranks 1,2

Run it where ``bench_convert`` runs (e.g. ``PYTHONPATH=.:.mcore/bridge-0.3.1:.mcore/0.16.1``).
Memory: N ranks of start-up plus the peaks it prints; disk: the model folder and one checkpoint.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_convert  # noqa: E402  (the shim is active from here on)

GIB = 2**30


def peaks(ranks):
    """``(through save, in verify)``: per rank, the peak from start to the end of save and the
    peak in verify."""
    save = [max(row["peak"] for name, row in table.items() if name != "verify") for table in ranks]
    return save, [table["verify"]["peak"] for table in ranks]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(bench_convert.SIZES), default="tiny",
                        help="the Llama-like model to write and convert (default tiny: a smoke run)")
    parser.add_argument("--hf", metavar="DIR", help="convert this Hugging Face model folder instead of writing one")
    parser.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated (default 1,2,4); TP = ranks")
    parser.add_argument("--dir", help="where to write the model and checkpoints (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (the rest on stderr)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.ranks.split(",")]
    stream = sys.stderr if args.json else sys.stdout

    def say(text=""):
        print(text, file=stream, flush=True)

    workdir = tempfile.mkdtemp(prefix="mcore-cpu-shim-bench-ranks-", dir=args.dir)
    results = {}
    try:
        if args.hf:
            hf, label = os.path.abspath(args.hf), args.hf
        else:
            hf, label = os.path.join(workdir, f"llama-{args.size}"), f"llama {args.size} preset"
            bench_convert.write_model(args.size, hf, say)
        for n in counts:
            say(f"convert import --verify --ranks {n} --tp {n}:")
            results[n], source = bench_convert.run_convert(
                hf, os.path.join(workdir, "megatron"), os.path.join(workdir, f"ranks-{n}"), stream,
                layout=["--ranks", str(n), "--tp", str(n)])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    model = source["bytes"]
    startup = results[counts[0]]["ranks"][0]["imports"]["peak"]
    facts = results[counts[0]]["facts"]
    say()
    say(f"model: {label}, {model / GIB:.2f} GiB in {source['files']} safetensors file(s), {source['tensors']} tensors; "
        f"start-up of one rank (peak after its imports): {startup / GIB:.2f} GiB")
    say(f"megatron-core {facts.get('megatron_core')}, Megatron-Bridge {facts.get('megatron_bridge')}, "
        f"torch {facts.get('torch')}; {os.cpu_count()} cores")
    say(f"{'ranks (TP)':>10}{'per-rank peak':>15}{'largest':>9}{'/ goal':>8}{'summed peak':>13}{'/ goal':>8}"
        f"{'verify peak':>13}{'summed / model':>16}")
    report = {"model": label, "model_bytes": model, "startup_bytes": startup, "facts": facts, "ranks": {}}
    for n in counts:
        save, verify = peaks(results[n]["ranks"])
        largest = max(range(n), key=save.__getitem__)
        goal_rank, goal_sum = model / n + startup, 1.3 * model + n * startup
        report["ranks"][n] = {"per_rank_peak": save, "verify_peak": verify, "goal_per_rank": goal_rank,
                              "goal_summed": goal_sum, "per_rank_phases": results[n]["ranks"]}
        say(f"{n:>10}{save[largest] / GIB:12.2f} GiB{'rank ' + str(largest):>9}{save[largest] / goal_rank:8.2f}"
            f"{sum(save) / GIB:10.2f} GiB{sum(save) / goal_sum:8.2f}{max(verify) / GIB:10.2f} GiB"
            f"{sum(save) / model:16.2f}")
    say("per rank and phase, peak GiB:")
    for n in counts:
        for rank, table in enumerate(results[n]["ranks"]):
            say(f"  {n} ranks, rank {rank}: " + ", ".join(
                f"{name} {row['peak'] / GIB:.2f}" for name, row in table.items()))
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
