import os

# Deterministic CPU numerics; tests never touch a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile far more than they run: LLVM at -O0 cuts the suite's time by a quarter, and
# XLA:CPU's legacy elemental emitters instead of its fusion emitters by a further third (every
# test passes either way; programs compared bit for bit are compiled alike). Added to the
# flags the caller set, unless the caller chose the emitters (XLA_FLAGS=
# --xla_cpu_use_fusion_emitters=true runs the suite with the fusion emitters); subprocesses
# inherit them. One LLVM module per program (no parallel codegen split): at -O0 with the
# legacy emitters, which split module a fusion lands in changed one float32 bit of a decode
# step's output, so that two programs holding the same step (a full cache and r = 1 through
# the compiled prefill kernel, session 45) differed; with one module they do not, and the
# suite runs about 15 % faster on two cores.
_flags = [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
if "xla_cpu_use_fusion_emitters" not in _flags[0]:
    _flags.append("--xla_cpu_use_fusion_emitters=false")
if "xla_cpu_parallel_codegen_split_count" not in _flags[0]:
    _flags.append("--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = " ".join(_flags).strip()
# No persistent XLA cache from CLI calls made inside the test process: tests stay hermetic, and
# a CI run once segfaulted inside XLA:CPU compilation on the cache-writing path.
os.environ.setdefault("JAXKV_NO_COMPILE_CACHE", "1")

# Dequantized-model cache inside the checkout (ignored by git), not in the user's home.
os.environ.setdefault(
    "JAXKV_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "jaxkv")
)
