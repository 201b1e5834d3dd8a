"""Benchmark (not a test): what the shim costs a torch_dist save and load on the CPU.

In one run, on the demo's GPT-OSS-like model (one rank, built once per side):

(a) ``dist_checkpointing.save`` and ``load`` with the shim on unmodified megatron-core versus
    megatron-core with ``patches/series`` applied (shim disabled): time ratio, target <= 1.01;
(b) save throughput versus plain ``torch.save`` of the same tensors;
(c) peak RSS (the process and its children) during save, relative to the model's tensor bytes.

Each side runs in its own interpreter with CUDA hidden and keeps its model; repetitions
alternate between the two sides (A B A B ...) so that drift on a shared machine hits both.
Build a patched tree with ``python tools/matrix.py patch 0.19.2`` (all patches must apply).

    python benchmarks/bench_save_load.py --patched-tree .mcore/0.19.2-patched --size 100M
    python benchmarks/bench_save_load.py --patched-tree .mcore/0.19.2-patched --size 1B --dtype bfloat16

Run it with megatron-core (unmodified) and this package importable, e.g.
``PYTHONPATH=.:.mcore/0.19.2``; the patched side puts the patched tree first on PYTHONPATH.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "tiny": dict(layers=2, hidden=64, heads=4, query_groups=2, ffn=128, experts=4, vocab=256),
    "100M": dict(layers=3, hidden=768, heads=12, query_groups=4, ffn=1024, experts=8, vocab=32000),
    "1B": dict(layers=8, hidden=1536, heads=12, query_groups=4, ffn=3072, experts=8, vocab=32000),
}


# ---------------------------------------------------------------- worker (one per side)


def rss_of_tree():
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakRss:
    """Samples the RSS of this process and its children every 10 ms while active."""

    def __enter__(self):
        self.peak, self.running = rss_of_tree(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_of_tree())
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def worker(spec):
    import mcore_cpu_shim  # noqa: F401  (first; MCORE_CPU_SHIM_DISABLE decides)
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from mcore_cpu_shim.app.demo_worker import build_model, parameter_count, tensors

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{spec['store']}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    model = build_model(spec, seed=1)
    state = tensors(model)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    reply = dict(parameters=parameter_count(model, 1), tensor_bytes=nbytes)
    print(json.dumps(reply), flush=True)

    for line in sys.stdin:
        command, path = line.split()
        shutil.rmtree(path, ignore_errors=True)
        if command == "dist":
            os.makedirs(path)
            before = rss_of_tree()
            with PeakRss() as rss:
                start = time.perf_counter()
                dist_checkpointing.save(model.sharded_state_dict(), path)
                save = time.perf_counter() - start
            start = time.perf_counter()
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
            load = time.perf_counter() - start
            reply = dict(save=save, load=load, rss_before=before, rss_peak=rss.peak,
                         fixes={k: v["state"] for k, v in mcore_cpu_shim.status().items()})
        else:  # "torch": plain torch.save of the same tensors
            start = time.perf_counter()
            torch.save(state, path)
            reply = dict(save=time.perf_counter() - start)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        print(json.dumps(reply), flush=True)


# ---------------------------------------------------------------- driver


class Side:
    def __init__(self, name, spec, workdir, pythonpath, disable):
        self.name = name
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=pythonpath)
        env.pop("MCORE_CPU_SHIM_DISABLE", None)
        if disable:
            env["MCORE_CPU_SHIM_DISABLE"] = "all"
        spec = dict(spec, store=os.path.join(workdir, f"store-{name}"))
        self.log = os.path.join(workdir, f"{name}.log")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            )
        self.info = self.read()
        # The first save starts megatron-core's writer helper process (seconds): not measured.
        self.fixes = self.ask("dist", os.path.join(workdir, name))["fixes"]

    def read(self):
        line = self.process.stdout.readline()
        if not line:
            with open(self.log) as log:
                sys.stderr.write(log.read()[-6000:])
            raise SystemExit(f"{self.name}: the worker died (its output is above)")
        return json.loads(line)

    def ask(self, command, path):
        self.process.stdin.write(f"{command} {path}\n")
        self.process.stdin.flush()
        return self.read()

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patched-tree", required=True, help="megatron-core with patches/series applied")
    parser.add_argument("--size", choices=sorted(SIZES), default="100M")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per side (default 3)")
    parser.add_argument("--dir", help="where to write checkpoints (default: a temporary folder)")
    parser.add_argument("--low-memory", action="store_true",
                        help="one side alive at a time: a fresh worker (model build, warm-up save) per measurement")
    args = parser.parse_args(argv)

    patched = os.path.abspath(args.patched_tree)
    if not os.path.isdir(os.path.join(patched, "megatron", "core")):
        parser.error(f"--patched-tree {args.patched_tree}: no megatron/core in it")
    spec = dict(SIZES[args.size], topk=2, seq_len=64, ep=1, dtype=args.dtype)
    workdir = tempfile.mkdtemp(prefix="mcore-cpu-shim-bench-", dir=args.dir)
    plain_path = os.environ.get("PYTHONPATH", "")
    paths = {
        "shim": (os.pathsep.join(filter(None, [ROOT, plain_path])), False),
        "patched": (os.pathsep.join(filter(None, [patched, ROOT, plain_path])), True),
    }
    runs = {"shim": [], "patched": [], "torch": []}
    fixes, infos, alive = {}, {}, {}

    def side(name):
        if name not in alive:
            new = alive[name] = Side(name, spec, workdir, *paths[name])
            if not infos:
                info = new.info
                print(f"model: {args.size} preset, {info['parameters']:,} parameters, "
                      f"{info['tensor_bytes'] / 2**30:.2f} GiB of {args.dtype} tensors", flush=True)
            fixes[name], infos[name] = new.fixes, new.info
        return alive[name]

    def done(name):
        if args.low_memory:
            alive.pop(name).close()

    try:
        for rep in range(args.reps):
            for name in ("shim", "patched") if rep % 2 == 0 else ("patched", "shim"):
                runs[name].append(side(name).ask("dist", os.path.join(workdir, name)))
                if name == "shim":
                    runs["torch"].append(side(name).ask("torch", os.path.join(workdir, "torch.pt")))
                done(name)
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{name} save {r[-1]['save']:.2f} s" + (f" load {r[-1]['load']:.2f} s" if "load" in r[-1] else "")
                for name, r in runs.items()), flush=True)
        info = infos["shim"]
        for worker_side in alive.values():
            worker_side.close()
        print(f"fix states: shim side {fixes['shim']}; patched side {fixes['patched']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(name, key):
        return statistics.median(r[key] for r in runs[name])

    gib = info["tensor_bytes"] / 2**30
    save_ratio = median("shim", "save") / median("patched", "save")
    load_ratio = median("shim", "load") / median("patched", "load")
    peak = max(r["rss_peak"] for r in runs["shim"])
    extra = max(r["rss_peak"] - r["rss_before"] for r in runs["shim"])
    report = {
        "parameters": info["parameters"],
        "tensor_gib": gib,
        "save_s": {"shim": median("shim", "save"), "patched": median("patched", "save"),
                   "torch.save": median("torch", "save")},
        "load_s": {"shim": median("shim", "load"), "patched": median("patched", "load")},
        "save_ratio_shim_vs_patched": save_ratio,
        "load_ratio_shim_vs_patched": load_ratio,
        "save_throughput_gib_s": {"shim": gib / median("shim", "save"), "torch.save": gib / median("torch", "save")},
        "throughput_ratio_shim_vs_torch_save": median("torch", "save") / median("shim", "save"),
        "peak_rss_over_tensor_bytes": peak / info["tensor_bytes"],
        "extra_rss_during_save_over_tensor_bytes": extra / info["tensor_bytes"],
    }
    print(f"(a) save time shim/patched: {save_ratio:.3f}, load time shim/patched: {load_ratio:.3f} (target <= 1.01)")
    print(f"(b) save throughput: shim {report['save_throughput_gib_s']['shim']:.2f} GiB/s, "
          f"torch.save {report['save_throughput_gib_s']['torch.save']:.2f} GiB/s, "
          f"ratio {report['throughput_ratio_shim_vs_torch_save']:.2f}")
    print(f"(c) peak RSS during save: {report['peak_rss_over_tensor_bytes']:.2f} x tensor bytes "
          f"(of which {report['extra_rss_during_save_over_tensor_bytes']:.2f} x added by the save)")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
