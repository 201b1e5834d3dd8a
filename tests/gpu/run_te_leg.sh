#!/usr/bin/env bash
# The GPU leg of issue 9: a checkpoint written with CUDA hidden (local layer spec) must load
# into the Transformer Engine model with CUDA visible. See tests/gpu/README.md.
#
#   tests/gpu/run_te_leg.sh WHEELS_DIR
#
# WHEELS_DIR holds the wheels to install (no network on the device machine): megatron-core
# (0.19.2 on Python 3.12), wrapt, psutil, mcore-cpu-shim, and numpy/packaging if the machine
# lacks them. torch (CUDA build) and, optionally, transformer-engine must be installed already.
# Exit status: 0 all stages passed, 1 a comparison failed, 2 setup failed (wheels, imports,
# no GPU), 3 Transformer Engine is not importable here (the CPU stage ran, the TE stage did not).
# Sized for 8 minutes: install ~1 min, then per model (dense, MoE) write <= 60 s, load <= 150 s.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WHEELS=${1:?usage: run_te_leg.sh WHEELS_DIR}
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/te-leg.XXXXXX")
echo "== work folder: $WORK"

echo "== interpreter and torch"
"$PY" - <<'PYEOF' || exit 2
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA build", torch.version.cuda)
print("CUDA usable:", torch.cuda.is_available(), "| devices:", torch.cuda.device_count())
sys.exit(0 if torch.cuda.is_available() else 1)
PYEOF

echo "== installing the carried wheels from $WHEELS (no index, no dependencies)"
ls "$WHEELS"/*.whl || { echo "SETUP FAILED: no wheels in $WHEELS"; exit 2; }
"$PY" -m pip install --quiet --no-index --no-deps --target "$WORK/site" "$WHEELS"/*.whl \
    || { echo "SETUP FAILED: pip could not install the wheels"; exit 2; }
export PYTHONPATH="$WORK/site:$HERE${PYTHONPATH:+:$PYTHONPATH}"

echo "== imports"
"$PY" - <<'PYEOF' || { echo "SETUP FAILED: see the missing modules above"; exit 2; }
import importlib, sys
missing = []
for name in ("numpy", "packaging", "wrapt", "psutil", "megatron.core", "mcore_cpu_shim"):
    try:
        module = importlib.import_module(name)
        print(f"  {name}: {getattr(module, '__version__', 'ok')}")
    except Exception as exc:
        missing.append(name)
        print(f"  {name}: MISSING ({type(exc).__name__}: {exc})")
sys.exit(1 if missing else 0)
PYEOF

echo "== Transformer Engine"
if "$PY" -c "import transformer_engine.pytorch as te, transformer_engine; print('  transformer_engine', transformer_engine.__version__)"; then
    HAVE_TE=1
else
    HAVE_TE=0
    echo "  Transformer Engine is NOT importable on this machine: the TE load stage cannot run."
fi

status=0
for kind in dense moe; do
    flag=""; [ "$kind" = moe ] && flag="--moe"
    ckpt="$WORK/ckpt-$kind"
    echo "== [$kind] write with CUDA hidden (local spec, Gloo)"
    if ! CUDA_VISIBLE_DEVICES="" timeout 60 "$PY" "$HERE/te_leg.py" write "$ckpt" $flag; then
        echo "RESULT [$kind] write: FAIL"; status=1; continue
    fi
    if [ "$HAVE_TE" = 0 ]; then
        echo "RESULT [$kind] load into TE: NOT RUN (no Transformer Engine)"; [ "$status" = 0 ] && status=3; continue
    fi
    echo "== [$kind] load into the TE model with CUDA visible, compare tensors and logits"
    if timeout 150 "$PY" "$HERE/te_leg.py" load "$ckpt" $flag; then
        echo "RESULT [$kind]: PASS"
    else
        echo "RESULT [$kind]: FAIL (or timed out)"; status=1
    fi
done
echo "== done (exit status $status)"
exit $status
