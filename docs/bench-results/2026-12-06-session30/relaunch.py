"""Session 30: session 29's screen again on a warm machine whose stores (4k, online_gen) and target are
already written: the first try ran GEN_GPUS' default, four generate processes on GPU 0, beside the four
4K runs, and all of them ran out of GPU memory. Runs the SCREEN it is given, reusing the stores."""
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("screen29", HERE.parent / "2026-12-06-session29/screen.py")
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
m.s25.store_4k = lambda: True
m.s25.online_gen_store = lambda gen: True
m.s25.s24.online_gen = lambda: None
if __name__ == "__main__":
    sys.exit(m.lg.guarded(m.main))
